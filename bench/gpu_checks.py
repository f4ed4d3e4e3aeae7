"""Checks for the first GPU: at most 5 minutes on one GPU where only torch (with CUDA) is installed.

No network and no model download: drmas's source comes with the checkout (``src/`` is put
on the path) and the few pure-Python wheels it needs beside torch travel with it
(DeepSpeed built from its sdist, pydantic; see ``--help``). Every model has random weights
and is built from a config. The report (JSON, ``--out``) is written after every check, also
when one fails: a check that raises is recorded with its error, and the next one runs.

- ``env``: versions, whether transformers has ``activation_checkpointing_enable`` (the GPU
  image's 5.12.1 does not), the GPU, free space in ``/dev/shm``.
- ``engine`` (one process per case): drmas's own ``DeepSpeedEngine`` and update loop
  (``train_worker_group``) on a Qwen3-0.6B-shaped model with the real 151,936-token vocabulary,
  built on the host as ``load_model`` leaves it, for ZeRO-2 + offload (the recipes), ZeRO-3 +
  offload (``bench/gpu_smoke.py``) and ZeRO-3: update, hand-over as ``update_rank`` makes
  it, offload, onload, next update. It records device memory after the offload while the
  hand-over is still referenced and after it is dropped (``torch.cuda.mem_get_info``),
  whether the optimizer state is identical over the offload/onload round trip, where each
  master partition, its gradient and its moments are after the onload, and whether the
  second update runs.
- ``microbatch``: one worst-case micro-batch of each GPU recipe (Qwen3-4B, Qwen2.5-7B shapes,
  random bf16 weights on the GPU) through drmas's loss (``micro_loss``: chunked log-probs,
  activation checkpointing): the allocator's forward and backward peaks above the weights,
  against ``drmas plan``'s activations, logits and gradients for that micro-batch.
- ``handover``: the transport SGLang's ``update_weights_from_tensor`` uses (torch's
  ``ForkingPickler``), to a spawned consumer that moves each tensor to its GPU as SGLang's
  scheduler does: CUDA views of one flat bf16 buffer (ZeRO-1/2's hand-over) arrive with their
  values; the GPU memory the views pin after a DeepSpeed-style ``flat.data = host copy``, and
  what dropping them gives back; host tensors (ZeRO-3's hand-over) become shared memory.

    python bench/gpu_checks.py --out /tmp/gpu_checks.json
    python bench/gpu_checks.py --checks env,engine --tiny   # a CPU rehearsal (tests do this)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))  # a bare checkout: drmas need not be installed

import torch

TINY_CONFIG = ROOT / "configs" / "math_tiny.yaml"
RECIPES = {
    "Qwen3-4B (math recipe)": ROOT / "configs" / "math_qwen3_4b_gpu.yaml",
    "Qwen2.5-7B (search recipe)": ROOT / "configs" / "search_qwen25_7b_gpu.yaml",
}
ENGINE_CASES = {
    "zero2-offload": (2, True),
    "zero3-offload": (3, True),
    "zero3": (3, False),
    "zero2": (2, False),
    "zero3-offload-moved-by-hand": (3, True),
}
"""name: (ZeRO stage, offload_optimizer). The last is a control: the onload that moved
ZeRO-3's offloaded master partitions and moments to the GPU by hand (before this fix); on a
GPU its second update is expected to fail, which shows the check can see the fault."""
CONTROL = "zero3-offload-moved-by-hand"
QWEN3_06B = {
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
}
"""Qwen3-0.6B's shape: big enough that a pinned copy of its weights (1.2 GB) shows in the
device's free memory, small enough to build on the host in seconds."""
TINY = QWEN3_06B | {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
TINY |= {"num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512}
GIB = 2**30


def device() -> torch.device:
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def device_used() -> int | None:
    """Bytes in use on the whole device (every process, the CUDA context included)."""
    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    return total - free


def gib(value: int | None) -> float | None:
    return None if value is None else round(value / GIB, 3)


# -- env -------------------------------------------------------------------------------


def check_env(args: argparse.Namespace) -> dict[str, Any]:
    import transformers

    versions = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    for name in ("deepspeed", "pydantic", "sglang", "peft"):
        try:
            versions[name] = __import__(name).__version__
        except Exception as error:
            versions[name] = f"unavailable: {type(error).__name__}: {error}"[:200]
    from transformers import PreTrainedModel

    shm = shutil.disk_usage("/dev/shm") if Path("/dev/shm").exists() else None
    report: dict[str, Any] = {
        "versions": versions,
        "has_activation_checkpointing_enable": hasattr(PreTrainedModel, "activation_checkpointing_enable"),
        "has_gradient_checkpointing_enable": hasattr(PreTrainedModel, "gradient_checkpointing_enable"),
        "dev_shm_free_gib": gib(shm.free) if shm else None,
        "cpu_count": os.cpu_count(),
    }
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        report |= {"gpu": torch.cuda.get_device_name(0), "gpu_total_gib": gib(total), "gpu_free_gib": gib(free)}
    return report


# -- engine ----------------------------------------------------------------------------


def build_model(shape: dict[str, Any], dtype: torch.dtype, on: torch.device | str = "cpu") -> torch.nn.Module:
    """A Qwen3 causal LM of ``shape`` with random weights, on ``on``."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**shape, max_position_embeddings=32768)
    torch.manual_seed(0)
    with torch.device(on):
        model = Qwen3ForCausalLM(config).to(dtype)
    return model


def qwen2_model(architecture: Any, dtype: torch.dtype, on: torch.device) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        hidden_size=architecture.hidden_size,
        intermediate_size=architecture.intermediate_size,
        num_hidden_layers=architecture.num_hidden_layers,
        num_attention_heads=architecture.num_attention_heads,
        num_key_value_heads=architecture.num_key_value_heads,
        vocab_size=architecture.vocab_size,
        tie_word_embeddings=architecture.tie_word_embeddings,
        max_position_embeddings=32768,
    )
    torch.manual_seed(0)
    with torch.device(on):
        return Qwen2ForCausalLM(config).to(dtype)


def random_rows(count: int, prompt: int, response: int, vocab: int, agents: list[str]) -> list[dict[str, Any]]:
    """Rows as the advantage stage writes them: ids, the rollout's log-probs, an advantage."""
    generator = torch.Generator().manual_seed(count * 7919 + prompt)
    rows = []
    for index in range(count):
        ids = torch.randint(1, vocab, (prompt + response,), generator=generator).tolist()
        rows.append(
            {
                "agent": agents[index % len(agents)],
                "prompt_ids": ids[:prompt],
                "response_ids": ids[prompt:],
                "rollout_logprobs": [-2.0] * response,
                "advantage": 1.0 if index % 2 else -1.0,
            }
        )
    return rows


def engine_config(stage: int, offload: bool, bf16: bool) -> Any:
    from drmas.config import load_config

    overrides = [
        "train.backend=deepspeed",
        f"train.zero_stage={stage}",
        f"train.offload_optimizer={str(offload).lower()}",
        f"models.tiny.dtype={'bfloat16' if bf16 else 'float32'}",
        "train.gradient_checkpointing=true",
        "train.micro_batch_size=2",
        "train.updates_per_iteration=2",
    ]
    return load_config(TINY_CONFIG, overrides)


def where(tensor: torch.Tensor | None) -> str | None:
    return None if tensor is None else str(tensor.device)


def optimizer_placement(engine: Any) -> list[dict[str, Any]]:
    """Per fp32 master partition: its device, its gradient's and its moments'."""
    zero = engine.engine.optimizer
    optimizer = zero.optimizer
    flats = zero.fp32_partitioned_groups_flat if engine.zero_stage == 3 else zero.single_partition_of_fp32_groups
    placement = []
    for flat in flats:
        state = optimizer.state.get(flat, {})
        placement.append(
            {
                "master": where(flat),
                "grad": where(flat.grad),
                "exp_avg": where(state.get("exp_avg")),
                "exp_avg_sq": where(state.get("exp_avg_sq")),
            }
        )
    return placement


def states_identical(before: Any, after: Any) -> dict[str, Any]:
    keys = sorted(set(before.tensors) | set(after.tensors))
    differing = [
        key
        for key in keys
        if key not in before.tensors
        or key not in after.tensors
        or not torch.equal(before.tensors[key], after.tensors[key])
    ]
    return {"tensors": len(keys), "differing": differing[:10], "identical": not differing}


def run_engine_case(name: str, tiny: bool) -> dict[str, Any]:
    """One case, in this process: update, hand-over, offload, onload, next update."""
    from drmas.stages.update import prepare_for_training
    from drmas.training.engines import make_engine, rank_and_world
    from drmas.training.loop import train_worker_group

    stage, offload = ENGINE_CASES[name]
    if name == CONTROL:
        import drmas.training.engines.deepspeed as deepspeed_engine

        deepspeed_engine.zero3_optimizer_homes = lambda zero, device: [device] * len(zero.fp32_partitioned_groups_flat)
    bf16 = torch.cuda.is_available()
    config = engine_config(stage, offload, bf16)
    group = config.worker_groups()[0]
    shape = TINY if tiny else QWEN3_06B
    started = time.perf_counter()
    model = build_model(shape, torch.bfloat16 if bf16 else torch.float32)
    prepare_for_training(model, checkpointing=True)
    report: dict[str, Any] = {"stage": stage, "offload_optimizer": offload, "bf16": bf16, "shape": shape}
    report["params"] = sum(p.numel() for p in model.parameters())
    engine = make_engine(model, group, config)
    rank, world = rank_and_world()
    rows = random_rows(8, 48, 48, shape["vocab_size"], list(group.agents))
    report["first_update"] = train_worker_group(config, group, engine, model, None, rows, 0, 0, rank, world)
    report["used_after_update_gib"] = gib(device_used())
    handover = engine.full_weights()
    if handover is None:
        handover = model.state_dict()  # update_rank's hand-over under ZeRO-0/1/2
    before = engine.export_state()
    engine.offload()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    report["used_after_offload_handover_held_gib"] = gib(device_used())
    del handover
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    report["used_after_offload_handover_dropped_gib"] = gib(device_used())
    engine.onload()
    if stage >= 1:
        report["placement_after_onload"] = optimizer_placement(engine)
    report["state_over_round_trip"] = states_identical(before, engine.export_state())
    try:
        report["second_update"] = train_worker_group(config, group, engine, model, None, rows, 0, 1, rank, world)
        report["second_update_ok"] = True
    except Exception as error:
        report["second_update_ok"] = False
        report["second_update_error"] = f"{type(error).__name__}: {error}"[:2000]
    report["seconds"] = round(time.perf_counter() - started, 1)
    report["passed"] = bool(report["second_update_ok"] and report["state_over_round_trip"]["identical"])
    if name == CONTROL and torch.cuda.is_available():
        report["passed"] = not report["second_update_ok"]  # the fault it stands for is seen
    return report


def check_engine(args: argparse.Namespace) -> dict[str, Any]:
    """Each case in a process of its own (DeepSpeed keeps a process group; a crash in one
    case must not take the others with it)."""
    results: dict[str, Any] = {}
    for name in args.cases.split(","):
        out = Path(args.out).with_suffix(f".{name}.json")
        command = [sys.executable, __file__, "--engine-case", name, "--out", str(out)] + (
            ["--tiny"] if args.tiny else []
        )
        env = os.environ | {"PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=args.case_timeout, env=env)
            tail = (done.stdout + done.stderr)[-3000:]
            results[name] = json.loads(out.read_text()) if out.is_file() else {"passed": False}
            if done.returncode != 0:
                results[name] |= {"passed": False, "exit": done.returncode, "output_tail": tail}
        except subprocess.TimeoutExpired:
            results[name] = {"passed": False, "error": f"took longer than {args.case_timeout} s"}
        print(f"  engine {name}: {'PASS' if results[name].get('passed') else 'FAIL'}", flush=True)
    return results


# -- microbatch ------------------------------------------------------------------------


def check_microbatch(args: argparse.Namespace) -> dict[str, Any]:
    from drmas.config import load_config
    from drmas.planning import architecture_of, plan_memory
    from drmas.stages.update import prepare_for_training
    from drmas.training.batching import collate
    from drmas.training.loop import MiniBatchSize, micro_loss

    if not torch.cuda.is_available():
        return {"skipped": "no GPU"}
    results: dict[str, Any] = {}
    for label, recipe in RECIPES.items():
        config = load_config(recipe)
        plan = plan_memory(config)
        group_plan, group = plan.groups[0], config.worker_groups()[0]
        architecture, _ = architecture_of(group.model, group.spec)
        rows_count = min(group.micro_batch_size, -(-group_plan.micro_batch_tokens // group_plan.sequence_tokens))
        length = group_plan.micro_batch_tokens // rows_count
        response = min(config.agent_sampling(group.agents[0]).max_new_tokens, length - 1)
        build = build_model if architecture.qk_norm else None
        torch.cuda.empty_cache()
        if build is not None:
            shape = {
                "hidden_size": architecture.hidden_size,
                "intermediate_size": architecture.intermediate_size,
                "num_hidden_layers": architecture.num_hidden_layers,
                "num_attention_heads": architecture.num_attention_heads,
                "num_key_value_heads": architecture.num_key_value_heads,
                "head_dim": architecture.head_dim,
                "vocab_size": architecture.vocab_size,
                "tie_word_embeddings": architecture.tie_word_embeddings,
            }
            model = build_model(shape, torch.bfloat16, device())
        else:
            model = qwen2_model(architecture, torch.bfloat16, device())
        prepare_for_training(model, config.train.gradient_checkpointing)
        rows = random_rows(rows_count, length - response, response, architecture.vocab_size, list(group.agents))
        batch = collate(rows, 0).to(device())
        size = MiniBatchSize(sum(len(r["response_ids"]) for r in rows), len(rows), 1)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        weights = torch.cuda.memory_allocated()
        started = time.perf_counter()
        loss, _ = micro_loss(model, None, batch, size, config, want_entropy=True)
        torch.cuda.synchronize()
        forward_peak = torch.cuda.max_memory_allocated() - weights
        torch.cuda.reset_peak_memory_stats()
        loss.backward()
        torch.cuda.synchronize()
        backward_peak = torch.cuda.max_memory_allocated() - weights
        seconds = time.perf_counter() - started
        planned = group_plan.activations + group_plan.logits
        results[label] = {
            "rows": rows_count,
            "tokens": rows_count * length,
            "plan_micro_batch_tokens": group_plan.micro_batch_tokens,
            "weights_gib": gib(weights),
            "forward_peak_above_weights_gib": gib(forward_peak),
            "backward_peak_above_weights_gib": gib(backward_peak),
            "plan_activations_gib": gib(group_plan.activations),
            "plan_logits_gib": gib(group_plan.logits),
            "plan_grads_gib": gib(group_plan.train_grads),
            "plan_update_peak_gib": gib(group_plan.update_peak),
            "bf16_grads_of_whole_model_gib": gib(sum(p.numel() * 2 for p in model.parameters())),
            "forward_measured_over_plan": round(forward_peak / planned, 3),
            "backward_measured_over_plan_with_whole_grads": round(
                backward_peak / (planned + sum(p.numel() * 2 for p in model.parameters())), 3
            ),
            "seconds": round(seconds, 2),
        }
        del model, batch, loss
        gc.collect()
        torch.cuda.empty_cache()
    return results


# -- handover --------------------------------------------------------------------------


def _consume(connection: Any) -> None:
    """SGLang's scheduler, as far as the transport goes: unpickle, move to the GPU, read."""
    import pickle

    payload = connection.recv_bytes()
    named = pickle.loads(payload)
    sums, same_storage = [], []
    for _, tensor in named:
        moved = tensor.to("cuda")
        same_storage.append(moved.data_ptr() == tensor.data_ptr())
        sums.append(float(moved.float().sum()))
    connection.send({"sums": sums, "zero_copy": all(same_storage), "device": str(named[0][1].device)})
    del named
    connection.recv()  # hold the tensors until the producer has measured


def check_handover(args: argparse.Namespace) -> dict[str, Any]:
    import multiprocessing
    from multiprocessing.reduction import ForkingPickler

    if not torch.cuda.is_available():
        return {"skipped": "no GPU"}
    report: dict[str, Any] = {}
    elements = 512 * 2**20  # 1 GiB of bf16
    flat = torch.randn(elements, dtype=torch.bfloat16, device="cuda")
    views = {f"layer{i}": flat[i * elements // 8 : (i + 1) * elements // 8].view(-1, 1024) for i in range(8)}
    expected = [float(t.float().sum()) for t in views.values()]
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    consumer = context.Process(target=_consume, args=(theirs,))
    consumer.start()
    ours.send_bytes(bytes(ForkingPickler.dumps(list(views.items()))))
    received = ours.recv()
    report["gpu_views"] = {
        "values_arrive": all(
            abs(a - b) <= 1e-3 * max(1.0, abs(a)) for a, b in zip(expected, received["sums"], strict=True)
        ),
        "consumer_zero_copy": received["zero_copy"],
        "consumer_device": received["device"],
    }
    ours.send("done")
    consumer.join(timeout=60)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = device_used()
    flat.data = flat.data.to("cpu")  # what DeepSpeed's offload_states does to its flat buffer
    gc.collect()
    torch.cuda.empty_cache()
    held = device_used()
    del views
    gc.collect()
    torch.cuda.empty_cache()
    dropped = device_used()
    report["gpu_views"] |= {
        "freed_by_offload_while_views_held_gib": gib(base - held) if base and held else None,
        "freed_once_views_dropped_gib": gib(held - dropped) if held and dropped else None,
        "buffer_gib": gib(elements * 2),
    }
    host = {f"layer{i}": torch.randn(2**20, dtype=torch.bfloat16) for i in range(4)}
    shm_before = shutil.disk_usage("/dev/shm").used
    pickled = ForkingPickler.dumps(list(host.items()))
    report["host_tensors"] = {
        "producer_storage_became_shared": all(t.is_shared() for t in host.values()),
        "dev_shm_growth_mib": round((shutil.disk_usage("/dev/shm").used - shm_before) / 2**20, 1),
        "tensors_mib": round(sum(t.numel() * 2 for t in host.values()) / 2**20, 1),
    }
    del pickled
    return report


# -- the report ------------------------------------------------------------------------

CHECKS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "env": check_env,
    "engine": check_engine,
    "microbatch": check_microbatch,
    "handover": check_handover,
}


def write_json(path: Path, value: Any) -> None:
    draft = path.with_suffix(path.suffix + ".draft")
    draft.parent.mkdir(parents=True, exist_ok=True)
    draft.write_text(json.dumps(value, indent=1, default=str))
    draft.replace(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="gpu_checks.json", help="the JSON report (written after every check)")
    parser.add_argument("--checks", default=",".join(CHECKS), help=f"comma-separated, of {', '.join(CHECKS)}")
    parser.add_argument("--cases", default=",".join(ENGINE_CASES), help="engine cases to run")
    parser.add_argument("--case-timeout", type=float, default=240.0)
    parser.add_argument("--tiny", action="store_true", help="tiny models: a rehearsal on any machine")
    parser.add_argument("--engine-case", help=argparse.SUPPRESS)  # one engine case, in this process
    args = parser.parse_args(argv)
    out = Path(args.out)
    if args.engine_case:
        try:
            write_json(out, run_engine_case(args.engine_case, args.tiny))
        except Exception:
            write_json(out, {"passed": False, "error": traceback.format_exc()[-4000:]})
            return 1
        return 0
    unknown = set(args.checks.split(",")) - set(CHECKS)
    if unknown:
        parser.error(f"unknown checks {sorted(unknown)}: choose from {sorted(CHECKS)}")
    report: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%S"), "checks": {}}
    failed = 0
    for name in args.checks.split(","):
        started = time.perf_counter()
        print(f"check {name} ...", flush=True)
        try:
            result = CHECKS[name](args)
        except Exception:
            result = {"passed": False, "error": traceback.format_exc()[-4000:]}
        result = result | {"check_seconds": round(time.perf_counter() - started, 1)}
        failed += int(
            result.get("passed") is False
            or any(isinstance(value, dict) and value.get("passed") is False for value in result.values())
        )
        report["checks"][name] = result
        write_json(out, report)
        print(f"check {name}: {json.dumps(result, default=str)[:1500]}", flush=True)
    return min(failed, 100)


if __name__ == "__main__":
    sys.exit(main())
