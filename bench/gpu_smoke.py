"""GPU smoke test: a 2-iteration math run of a small pretrained model, then PASS/FAIL per check.

For a machine with one GPU and the drmas GPU image (SGLang, DeepSpeed on CUDA); no network:
the model comes from a local folder in Hugging Face layout (e.g. Qwen2.5-0.5B-Instruct or
Qwen3-0.6B). It writes a config from ``configs/math_qwen3_4b_gpu.yaml`` with that model,
2 iterations, a tiny batch, one GPU in the pool (``ray.pool_resource: GPU``), DeepSpeed
ZeRO-3 and bfloat16, runs ``drmas run`` on it (a subprocess with a timeout) and checks:

- the run completed (exit 0, the last iteration's checkpoint committed);
- every worker group's policy of iteration 1 exists and differs from iteration 0's;
- the update's ``wg/*/logprob_gap`` is small: the rollout engine and the trainer agree;
- the gradient norms are finite and no step was skipped for a non-finite norm;
- the update's peak GPU memory (``wg/*/peak_memory_gib``) was measured;
- SGLang's weight sync (``--sglang``): an engine started on the initial policy, released and
  loaded with iteration 1's policy as the pool does, generates greedily what transformers
  generates from the stored iteration-1 policy.

The exit code is the number of failed checks. ``--dry-run`` only writes and validates the
config (it runs anywhere; ``tests/test_gpu_smoke.py`` runs it on CPU).

    python bench/gpu_smoke.py --model /models/Qwen2.5-0.5B-Instruct --out /tmp/smoke
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from safetensors.torch import load_file

from drmas.config import ConfigError, SamplingConfig, load_config
from drmas.infra.layout import init_policy_path, policy_path, stage_path

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "configs" / "math_qwen3_4b_gpu.yaml"
EXPERIMENT = "gpu-smoke"
RUN_ID = "smoke"
ITERATIONS = 2
SYNC_PROMPT = "What is 17 + 25? Put the answer in \\boxed{}."


@dataclass(frozen=True)
class Check:
    name: str
    passed: bool
    detail: str


def smoke_config(recipe: dict[str, Any], model: Path, sglang: bool, out: Path) -> dict[str, Any]:
    """The recipe with ``model`` for every agent and everything made small: 2 iterations
    of 4 prompts x 4 episodes on the generated arithmetic set, a local store, tracking and
    Ray, one GPU in the pool, DeepSpeed ZeRO-3 in bfloat16."""
    config = json.loads(json.dumps(recipe))  # a deep copy of plain YAML data
    [spec] = config["models"].values()
    config["models"] = {"policy": {**spec, "source": str(model), "dtype": "bfloat16"}}
    config["agents"] = [{**agent, "model": "policy"} for agent in config["agents"]]
    config["experiment"] = {"name": EXPERIMENT, "iterations": ITERATIONS, "seed": 0}
    config["data"] = {"generated_train_size": 64, "generated_eval_size": 8}  # generated:arithmetic
    config["rollout"] |= {
        "group_size": 4,
        "prompts_per_iteration": 4,
        "max_prompt_tokens": 1024,
        "engine": "sglang" if sglang else "hf",
        "sampling": {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_new_tokens": 256},
    }
    config["train"] |= {"zero_stage": 3, "backend": "deepspeed", "micro_batch_size": 2, "lr": 1.0e-5}
    config["eval"] = {"every": ITERATIONS, "k": 1, "max_questions": 4, "sampling": {"temperature": 0.0}}
    config["store"] = {"root": str(out / "runs")}
    config["tracking"] = {"uri": f"sqlite:///{out / 'mlflow.db'}"}
    config["ray"] = {"pool_resource": "GPU", "pool_size": 1, "max_resident": 1}
    return config


def write_config(model: Path, sglang: bool, out: Path) -> Path:
    """Write the smoke config to ``out/smoke.yaml`` once drmas has validated it (a bad one
    raises drmas's ConfigError naming the field, and nothing is left at that path)."""
    config = smoke_config(yaml.safe_load(RECIPE.read_text()), model, sglang, out)
    out.mkdir(parents=True, exist_ok=True)
    draft, path = out / "smoke.yaml.draft", out / "smoke.yaml"
    draft.write_text(yaml.safe_dump(config, sort_keys=False))
    try:
        load_config(draft)
    except Exception:
        draft.unlink()
        raise
    return draft.replace(path)


def drmas_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "drmas.cli", *args]


def check_config_cli(path: Path) -> Check:
    done = subprocess.run(drmas_command("config", str(path)), capture_output=True, text=True)
    detail = "drmas config accepts it" if done.returncode == 0 else done.stderr.strip()[-2000:]
    return Check("config valid (drmas config)", done.returncode == 0, detail)


def check_run(path: Path, store: Path, timeout: float) -> Check:
    try:
        done = subprocess.run(drmas_command("run", str(path), "--run-id", RUN_ID), timeout=timeout)
    except subprocess.TimeoutExpired:
        return Check("run completed", False, f"drmas run took longer than {timeout:.0f} s")
    committed = store / stage_path(EXPERIMENT, RUN_ID, ITERATIONS - 1, "checkpoint") / "_MANIFEST.json"
    passed = done.returncode == 0 and committed.is_file()
    return Check("run completed", passed, f"exit {done.returncode}, last checkpoint committed: {committed.is_file()}")


def worker_groups(path: Path) -> list[str]:
    return [group.name for group in load_config(path).worker_groups()]


def policy_dir(store: Path, wg: str, iteration: int | None) -> Path:
    """Iteration ``iteration``'s stored policy of ``wg``, or the initial one (None)."""
    if iteration is None:
        return store / init_policy_path(EXPERIMENT, RUN_ID, wg)
    return store / policy_path(EXPERIMENT, RUN_ID, iteration, wg)


def read_weights(folder: Path) -> dict[str, Any]:
    weights: dict[str, Any] = {}
    for file in sorted(folder.glob("*.safetensors")):
        weights |= load_file(str(file))
    return weights


def check_policies_moved(store: Path, groups: list[str]) -> Check:
    problems = []
    for wg in groups:
        before, after = policy_dir(store, wg, ITERATIONS - 2), policy_dir(store, wg, ITERATIONS - 1)
        missing = [folder for folder in (before, after) if not (folder / "_MANIFEST.json").is_file()]
        if missing:
            problems.append(f"{wg}: no committed policy at {', '.join(map(str, missing))}")
            continue
        old, new = read_weights(before), read_weights(after)
        if old.keys() != new.keys() or all(old[key].equal(new[key]) for key in old):
            problems.append(f"{wg}: iteration {ITERATIONS - 1}'s weights equal iteration {ITERATIONS - 2}'s")
    return Check("policies updated", not problems, "; ".join(problems) or f"{len(groups)} worker group(s) moved")


def update_metrics(store: Path, groups: list[str]) -> dict[str, dict[str, float]]:
    """Each update's metrics, keyed ``{wg}@{iteration}``."""
    found = {}
    for wg in groups:
        for iteration in range(ITERATIONS):
            metrics = policy_dir(store, wg, iteration) / "metrics.json"
            if metrics.is_file():
                found[f"{wg}@{iteration}"] = json.loads(metrics.read_text())
    return found


def check_metric(
    metrics: dict[str, dict[str, float]], name: str, suffix: str, ok: Callable[[float], bool], expected: str
) -> Check:
    """Every update's ``wg/{wg}/{suffix}`` satisfies ``ok``."""
    values = {
        update: value for update, found in metrics.items() for key, value in found.items() if key.endswith(f"/{suffix}")
    }
    bad = {update: value for update, value in values.items() if not ok(value)}
    missing = sorted(set(metrics) - set(values))
    passed = bool(values) and not bad and not missing
    shown = ", ".join(f"{update}={value:.4g}" for update, value in sorted(values.items()))
    detail = f"{shown or 'no values'} (expected {expected})" + (f"; missing in {missing}" if missing else "")
    return Check(name, passed, detail)


def check_engine_sync(store: Path, wg: str, tokens: int) -> Check:
    """SGLang started on the initial policy, released, and handed the last policy's weights
    in memory (the pool's path: the engine releases its memory for the update, the update
    hands it the new weights, the engine pushes them when it resumes) generates greedily
    what transformers generates from the stored last policy."""
    import torch  # the GPU's torch, SGLang (GPU image only) and transformers: only for this check

    from drmas.generation.engines.sglang import SGLangEngine
    from drmas.models import load_model, load_tokenizer

    last = policy_dir(store, wg, ITERATIONS - 1)
    tokenizer = load_tokenizer(last)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": SYNC_PROMPT}], add_generation_prompt=True, tokenize=False
    )
    prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
    engine = SGLangEngine(dtype="bfloat16")
    try:
        engine.load(policy_dir(store, wg, None))
        engine.offload()
        engine.set_weights(load_model(last, "bfloat16").state_dict())
        greedy = SamplingConfig(temperature=0.0, max_new_tokens=tokens)
        [generated] = engine.generate([prompt], greedy, stop_ids=[tokenizer.eos_token_id], seeds=[0])
    finally:
        if engine.engine is not None:
            engine.engine.shutdown()
    model = load_model(last, "bfloat16").to("cuda")
    with torch.no_grad():
        output = model.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=tokens, do_sample=False)
    reference = output[0, len(prompt) :].tolist()[: len(generated.response_ids)]
    passed = generated.response_ids == reference
    agree = next((i for i, (a, b) in enumerate(zip(generated.response_ids, reference, strict=False)) if a != b), None)
    detail = "identical" if passed else f"first difference at token {agree} of {len(generated.response_ids)}"
    return Check(f"SGLang weight sync ({wg})", passed, f"{detail}: {tokenizer.decode(generated.response_ids)!r}")


def run_checks(path: Path, out: Path, args: argparse.Namespace) -> list[Check]:
    store = out / "runs"
    checks = [check_config_cli(path), check_run(path, store, args.timeout)]
    groups = worker_groups(path)
    metrics = update_metrics(store, groups)
    checks += [
        check_policies_moved(store, groups),
        check_metric(
            metrics, "rollout/trainer log-prob gap", "logprob_gap", lambda v: v <= args.max_gap, f"<= {args.max_gap}"
        ),
        check_metric(metrics, "grad norms finite", "grad_norm", math.isfinite, "finite"),
        check_metric(metrics, "no step skipped", "skipped", lambda v: v == 0, "0"),
        check_metric(metrics, "peak GPU memory (GiB)", "peak_memory_gib", lambda v: 0 < v < math.inf, "> 0"),
    ]
    if args.sglang:
        checks.append(check_engine_sync(store, groups[0], args.sync_tokens))
    return checks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="local model folder (Hugging Face layout)")
    parser.add_argument("--out", type=Path, default=Path("gpu-smoke"), help="config, store and MLflow go here")
    parser.add_argument(
        "--sglang", action=argparse.BooleanOptionalAction, default=True, help="roll out with SGLang (default) or HF"
    )
    parser.add_argument("--timeout", type=float, default=1800, help="seconds allowed for drmas run (default 1800)")
    parser.add_argument("--max-gap", type=float, default=0.1, help="largest mean |log-prob gap| (default 0.1)")
    parser.add_argument("--sync-tokens", type=int, default=32, help="greedy tokens compared for the sync check")
    parser.add_argument("--dry-run", action="store_true", help="only write and validate the config")
    args = parser.parse_args(argv)
    out = args.out.resolve()
    try:
        path = write_config(args.model.resolve(), args.sglang, out)
    except ConfigError as error:
        print(f"FAIL  config valid: {error}")
        return 1
    print(f"config: {path}")
    checks = [check_config_cli(path)] if args.dry_run else run_checks(path, out, args)
    for check in checks:
        print(f"{'PASS' if check.passed else 'FAIL'}  {check.name}: {check.detail}")
    failed = sum(not check.passed for check in checks)
    print(f"{len(checks) - failed} passed, {failed} failed")
    return failed


if __name__ == "__main__":
    raise SystemExit(main())
