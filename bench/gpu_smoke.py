"""GPU smoke test: a 2-iteration math run of a small pretrained model, then PASS/FAIL per check.

For a machine with one GPU and the drmas GPU image (SGLang, DeepSpeed on CUDA); no network:
the model comes from a local folder in Hugging Face layout (e.g. Qwen2.5-0.5B-Instruct or
Qwen3-0.6B). It writes a config from ``configs/math_qwen3_4b_gpu.yaml`` with that model,
2 iterations, a tiny batch, one GPU in the pool (``ray.pool_resource: GPU``), DeepSpeed
ZeRO-2 with the recipe's optimizer offload (``--zero-stage 3``: ZeRO-3), bfloat16 and lr
1e-4 (``--lr``: one step must move the log-probs measurably, or a stale engine could not be
told from a fresh one; the recipe's 1e-6 barely moves bf16 weights), runs ``drmas run`` on
it (a subprocess with a timeout) and checks:

- the run completed (exit 0, the last iteration's checkpoint committed);
- every worker group's policy of iteration 1 exists and differs from iteration 0's;
- the update's ``wg/*/logprob_gap`` is small: the rollout engine and the trainer agree;
- the gradient norms are finite and no step was skipped for a non-finite norm;
- the update's peak GPU memory (``wg/*/peak_memory_gib``) was measured (> 0; it says
  nothing about the release, see below);
- SGLang (``--sglang``, the default) gives its memory back: the device's free memory
  (``torch.cuda.mem_get_info``, every process) before an engine starts on the initial
  policy, with it resident and after its release (``SGLangEngine.offload``): the release
  gives back at least ``--min-release`` (0.8) of what the engine took;
- SGLang's weight sync: that engine, released, is handed iteration 1's weights in memory as
  ``update_rank`` hands them (GPU tensors under ZeRO-2, host copies under ZeRO-3) through
  ``SGLangEngine.set_weights``; its log-probs of a fixed text (prompt log-probs,
  ``logprob_start_len=0``), after the push and again after a release and resume (the host
  backup), equal within ``--sync-tol`` those of the same engine loaded with
  ``update_weights_from_disk`` from the stored iteration-1 folder (identical expected:
  deterministic inference, same kernels), while the initial policy's differ by at least
  ``--stale-ratio`` x ``--sync-tol`` (else a stale engine would pass too);
- the rollout engine held the update: iteration 1's rollout log-probs (the engine must hold
  iteration 0's update by then, pushed in memory through the pool) scored with the
  trainer's code (``token_logprobs``) under iteration 0's stored policy and under the
  initial policy: the gap to the first is at most ``--max-gap`` and the gap to the second
  at least ``--stale-ratio`` times that (and at least 0.01).

Every check is recorded PASS or FAIL with its detail; a check that raises (e.g. a missing
iteration-1 policy after a failed run) is a FAIL with its error, and the next one still
runs. The JSON report (``--report``, default ``OUT/report.json``) is rewritten after every
check, so a failed or interrupted run leaves one. The exit code is the number of failed
checks. ``--dry-run`` only writes and validates the config, and reports that (it runs
anywhere; ``tests/test_gpu_smoke.py`` runs it on CPU).

    python bench/gpu_smoke.py --model /models/Qwen2.5-0.5B-Instruct --out /tmp/smoke
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import math
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml
from safetensors.torch import load_file

from drmas.config import load_config
from drmas.infra.layout import init_policy_path, policy_path, stage_path
from drmas.infra.schema import TRAJECTORY_SCHEMA
from drmas.infra.store import Store

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "configs" / "math_qwen3_4b_gpu.yaml"
EXPERIMENT = "gpu-smoke"
RUN_ID = "smoke"
ITERATIONS = 2
SMOKE_LR = 1.0e-4
SYNC_PROMPT = "What is 17 + 25? Put the answer in \\boxed{}."
SYNC_ANSWER = "17 + 25 = 42, so the answer is \\boxed{42}."
MIN_SHIFT = 0.01
"""The least mean |log-prob difference| per token between the policy an engine should hold
and the stale one for the staleness check to mean anything."""
GIB = 2**30


@dataclass(frozen=True)
class Check:
    name: str
    passed: bool
    detail: str


def smoke_config(
    recipe: dict[str, Any], model: Path, sglang: bool, out: Path, zero_stage: int = 2, lr: float = SMOKE_LR
) -> dict[str, Any]:
    """The recipe with ``model`` for every agent and everything made small: 2 iterations
    of 4 prompts x 4 episodes on the generated arithmetic set, a local store, tracking and
    Ray, one GPU in the pool, DeepSpeed at ``zero_stage`` with the recipe's optimizer
    offload, bfloat16, learning rate ``lr``."""
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
    config["train"] |= {"zero_stage": zero_stage, "backend": "deepspeed", "micro_batch_size": 2, "lr": lr}
    config["eval"] = {"every": ITERATIONS, "k": 1, "max_questions": 4, "sampling": {"temperature": 0.0}}
    config["store"] = {"root": str(out / "runs")}
    config["tracking"] = {"uri": f"sqlite:///{out / 'mlflow.db'}"}
    config["ray"] = {"pool_resource": "GPU", "pool_size": 1, "max_resident": 1}
    return config


def write_config(model: Path, sglang: bool, out: Path, zero_stage: int = 2, lr: float = SMOKE_LR) -> Path:
    """Write the smoke config to ``out/smoke.yaml`` once drmas has validated it (a bad one
    raises drmas's ConfigError naming the field, and nothing is left at that path)."""
    config = smoke_config(yaml.safe_load(RECIPE.read_text()), model, sglang, out, zero_stage, lr)
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


# -- the run and its artifacts ----------------------------------------------------------


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


# -- comparisons (pure: tested on CPU with hand-made inputs) -----------------------------


def mean_abs_gap(a: Sequence[Sequence[float]], b: Sequence[Sequence[float]]) -> float:
    """Token-mean |a - b| over rows of per-token log-probs (the rows' lengths must match)."""
    if len(a) != len(b) or any(len(x) != len(y) for x, y in zip(a, b, strict=False)):
        raise ValueError("the log-probs compared are not of the same rows and tokens")
    tokens = sum(len(row) for row in a)
    if tokens == 0:
        raise ValueError("no tokens to compare")
    return sum(abs(x - y) for xs, ys in zip(a, b, strict=True) for x, y in zip(xs, ys, strict=True)) / tokens


def max_abs_diff(a: Sequence[float], b: Sequence[float]) -> float:
    """Largest |a - b| of two log-prob lists of the same tokens."""
    if len(a) != len(b) or not a:
        raise ValueError(f"the log-probs compared are of different or no tokens ({len(a)} and {len(b)})")
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def staleness_problem(fresh: float, stale: float, max_gap: float, ratio: float) -> str | None:
    """Why an engine whose log-probs are ``fresh`` (mean |gap| per token) from the policy it
    should hold and ``stale`` from the one before is not shown to hold the new one, or None.
    A stale engine is near the old policy and far from the new one, so it fails either the
    first test or the second; when the two policies are close the check cannot tell, and
    says so (a FAIL: it would pass a stale engine too)."""
    if not fresh <= max_gap:
        return f"{fresh:.4g} from the policy it should hold (expected <= {max_gap})"
    if not stale >= max(ratio * fresh, MIN_SHIFT):
        return (
            f"{stale:.4g} from the previous policy against {fresh:.4g} from the one it should hold "
            f"(expected >= {ratio:g}x and >= {MIN_SHIFT}): a stale engine would not be told apart"
        )
    return None


def sync_check(found: dict[str, Any], tol: float, ratio: float, wg: str) -> Check:
    """The engine probe's log-probs of the fixed text: after the in-memory push
    (``pushed``) and after a release/resume (``cycled``) against the same engine loaded
    from disk with the same policy (``from_disk``); ``initial`` (the engine on the
    initial policy) must be at least ``ratio`` x ``tol`` away, or a stale engine would pass."""
    name = f"SGLang weight sync ({wg})"
    if any(key not in found for key in ("initial", "pushed", "cycled", "from_disk")):
        raise RuntimeError(f"the engine probe stopped before it: {found.get('error', 'no error recorded')}")
    pushed = max_abs_diff(found["pushed"], found["from_disk"])
    cycled = max_abs_diff(found["cycled"], found["from_disk"])
    initial = max_abs_diff(found["initial"], found["from_disk"])
    problems = []
    if not pushed <= tol:
        problems.append(f"after the push {pushed:.3g} from the disk load (> {tol:g})")
    if not cycled <= tol:
        problems.append(f"after a release and resume {cycled:.3g} from the disk load (> {tol:g})")
    if not initial >= ratio * tol:
        problems.append(f"the initial policy only {initial:.3g} away (< {ratio:g} x {tol:g}): stale would pass")
    tokens = len(found["from_disk"])
    detail = "; ".join(problems) or (
        f"max |log-prob difference| over {tokens} tokens: push {pushed:.3g}, after release/resume "
        f"{cycled:.3g}, initial policy {initial:.3g}"
    )
    return Check(name, not problems, detail)


def release_check(found: dict[str, Any], min_share: float) -> Check:
    """What an engine took from the device's free memory when it started, and how much of
    it its release gave back (free memory of the whole device, every process)."""
    if any(key not in found for key in ("free_before", "free_resident", "free_released")):
        raise RuntimeError(f"the engine probe stopped before it: {found.get('error', 'no error recorded')}")
    taken = found["free_before"] - found["free_resident"]
    given = found["free_released"] - found["free_resident"]
    passed = taken > 0 and given >= min_share * taken
    share = f"{given / taken:.0%}" if taken > 0 else "n/a"
    detail = (
        f"the engine took {taken / GIB:.2f} GiB, its release gave back {given / GIB:.2f} GiB ({share}, "
        f"expected >= {min_share:.0%}); free: {found['free_before'] / GIB:.2f} before, "
        f"{found['free_resident'] / GIB:.2f} resident, {found['free_released'] / GIB:.2f} released"
    )
    return Check("SGLang release frees memory", passed, detail)


def prompt_logprobs(output: dict[str, Any]) -> list[float]:
    """The prompt tokens' log-probs of one ``Engine.generate`` output with
    ``return_logprob=True, logprob_start_len=0``: ``meta_info["input_token_logprobs"]`` is
    ``(logprob, token_id, text)`` per prompt token, the first one's logprob None."""
    entries = output["meta_info"]["input_token_logprobs"]
    if len(entries) < 2 or entries[0][0] is not None:
        raise ValueError(f"not prompt log-probs from position 0: {entries[:2]}")
    return [float(logprob) for logprob, _, _ in entries[1:]]


# -- the rollout engine held the update (the run's iteration-1 rollout) -----------------


def score_rows(folder: Path, rows: list[dict[str, Any]], config: Any, dtype: str, device: str) -> list[list[float]]:
    """The response tokens' log-probs of ``rows`` under the policy in ``folder``, computed
    as the trainer does (``token_logprobs`` at each agent's sampling temperature)."""
    import torch

    from drmas.models import load_model
    from drmas.training.batching import collate, micro_batches, sampling_temperatures, token_logprobs

    model = load_model(folder, dtype).to(device)
    scored: list[list[float]] = [[] for _ in rows]
    try:
        with torch.no_grad():
            for pack in micro_batches(rows, 2, None):
                batch = collate([rows[i] | {"advantage": 0.0} for i in pack], 0).to(torch.device(device))
                temperature = sampling_temperatures(config, batch.agents)
                logprobs, _ = token_logprobs(model, batch, False, temperature, config.train.logprob_chunk_positions)
                for b, index in enumerate(pack):
                    scored[index] = logprobs[b][batch.response_mask[b] > 0].float().tolist()
    finally:
        del model
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return scored


def check_not_stale(store: Path, path: Path, max_gap: float, ratio: float, max_rows: int) -> Check:
    """Iteration 1's rollout was generated by an engine that must hold iteration 0's update
    (pushed in memory by the pool): its log-probs must be near that policy's and far from
    the initial policy's, both scored here with the trainer's code."""
    import pyarrow.compute as pc
    import torch

    config = load_config(path)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    artifact = Store(str(store)).open(stage_path(EXPERIMENT, RUN_ID, ITERATIONS - 1, "rollout"))
    table = artifact.read_table("trajectories.parquet", TRAJECTORY_SCHEMA)
    problems, shown = [], []
    for group in config.worker_groups():
        mine = table.filter(pc.equal(table["wg"], group.name))
        rows = mine.select(["agent", "prompt_ids", "response_ids", "rollout_logprobs"]).to_pylist()
        rows = [row for row in rows if row["response_ids"]][:max_rows]
        if not rows:
            problems.append(f"{group.name}: no rows in iteration {ITERATIONS - 1}'s rollout")
            continue
        dtype = group.spec.dtype if group.spec is not None else "bfloat16"
        engine = [row["rollout_logprobs"] for row in rows]
        expected = score_rows(policy_dir(store, group.name, ITERATIONS - 2), rows, config, dtype, device)
        previous = score_rows(policy_dir(store, group.name, None), rows, config, dtype, device)
        fresh, stale = mean_abs_gap(engine, expected), mean_abs_gap(engine, previous)
        shown.append(
            f"{group.name}: {fresh:.4g} from iteration {ITERATIONS - 2}'s policy, {stale:.4g} from the initial "
            f"({sum(map(len, engine))} tokens of {len(rows)} rows; the update moved them "
            f"{mean_abs_gap(expected, previous):.4g})"
        )
        if problem := staleness_problem(fresh, stale, max_gap, ratio):
            problems.append(f"{group.name}: {problem}")
    detail = "; ".join(problems + shown)
    return Check(f"rollout engine held the update (iteration {ITERATIONS - 1})", not problems and bool(shown), detail)


# -- the SGLang engine probe (GPU image only) -------------------------------------------


def sync_ids(tokenizer: Any) -> list[int]:
    """The fixed text whose log-probs the probe compares: a chat prompt and an answer."""
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": SYNC_PROMPT}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer(prompt + SYNC_ANSWER, add_special_tokens=False)["input_ids"]


def probe_engine(store: Path, model: Path, wg: str, zero_stage: int) -> dict[str, Any]:
    """Measurements of one SGLang engine driven as the pool drives it; what it got before
    an error, and the error (``error``)."""
    found: dict[str, Any] = {}
    try:
        _probe(found, store, model, wg, zero_stage)
    except Exception as error:
        found["error"] = f"{type(error).__name__}: {error}"[:2000]
    return found


def _probe(found: dict[str, Any], store: Path, model: Path, wg: str, zero_stage: int) -> None:
    import torch  # the GPU's torch, SGLang (GPU image only) and transformers: only here

    from drmas.generation.engines.sglang import SGLangEngine
    from drmas.models import load_model, load_tokenizer

    initial, updated = policy_dir(store, wg, None), policy_dir(store, wg, ITERATIONS - 1)
    start = initial if initial.is_dir() else model  # the release needs no run, only a model
    ids = sync_ids(load_tokenizer(start))

    def free() -> int:
        torch.cuda.synchronize()
        return torch.cuda.mem_get_info()[0]

    def score() -> list[float]:
        engine.resume()  # as the engine's own generate does
        params = [{"temperature": 1.0, "max_new_tokens": 1}]
        [output] = engine.engine.generate(
            input_ids=[ids], sampling_params=params, return_logprob=True, logprob_start_len=0
        )
        return prompt_logprobs(output)

    found["free_before"] = free()
    engine = SGLangEngine(dtype="bfloat16")
    try:
        engine.load(start)
        found["free_resident"] = free()
        found["initial"] = score()
        engine.offload()
        found["free_released"] = free()
        policy = load_model(updated, "bfloat16")
        if zero_stage < 3:
            policy.to("cuda")  # ZeRO-2's hand-over: views of the GPU weights; ZeRO-3's: host copies
        engine.set_weights(policy.state_dict())
        del policy
        gc.collect()
        torch.cuda.empty_cache()
        found["pushed"] = score()
        engine.offload()
        found["cycled"] = score()
        engine.load(updated)  # resident: update_weights_from_disk
        found["from_disk"] = score()
    finally:
        if engine.engine is not None:
            engine.engine.shutdown()


# -- the report -------------------------------------------------------------------------


def attempt(name: str, check: Callable[[], Check]) -> Check:
    """The check's result, or a FAIL with its error if it raised."""
    try:
        return check()
    except Exception as error:
        return Check(name, False, f"raised {type(error).__name__}: {error}"[:2000])


def write_report(path: Path, checks: list[Check], meta: dict[str, Any], finished: bool) -> None:
    failed = sum(not check.passed for check in checks)
    report = meta | {
        "finished": finished,
        "passed": len(checks) - failed,
        "failed": failed,
        "checks": [asdict(check) for check in checks],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    draft = path.with_name(path.name + ".draft")
    draft.write_text(json.dumps(report, indent=1, default=str))
    draft.replace(path)


def run_steps(steps: list[tuple[str, Callable[[], Check]]], report: Path, meta: dict[str, Any]) -> list[Check]:
    """Every step in order, each printed and added to the report as it ends."""
    checks: list[Check] = []
    for name, step in steps:
        check = attempt(name, step)
        checks.append(check)
        print(f"{'PASS' if check.passed else 'FAIL'}  {check.name}: {check.detail}", flush=True)
        write_report(report, checks, meta, finished=False)
    write_report(report, checks, meta, finished=True)
    return checks


def smoke_steps(path: Path, out: Path, args: argparse.Namespace) -> list[tuple[str, Callable[[], Check]]]:
    store = out / "runs"
    groups = functools.cache(lambda: worker_groups(path))
    metrics = functools.cache(lambda: update_metrics(store, groups()))
    probe = functools.cache(lambda: probe_engine(store, args.model.resolve(), groups()[0], args.zero_stage))

    def metric(name: str, suffix: str, ok: Callable[[float], bool], expected: str) -> tuple[str, Callable[[], Check]]:
        return name, lambda: check_metric(metrics(), name, suffix, ok, expected)

    steps: list[tuple[str, Callable[[], Check]]] = [
        ("config valid (drmas config)", lambda: check_config_cli(path)),
        ("run completed", lambda: check_run(path, store, args.timeout)),
        ("policies updated", lambda: check_policies_moved(store, groups())),
        metric("rollout/trainer log-prob gap", "logprob_gap", lambda v: v <= args.max_gap, f"<= {args.max_gap}"),
        metric("grad norms finite", "grad_norm", math.isfinite, "finite"),
        metric("no step skipped", "skipped", lambda v: v == 0, "0"),
        metric("peak GPU memory (GiB)", "peak_memory_gib", lambda v: 0 < v < math.inf, "> 0"),
    ]
    if args.sglang:  # before the staleness check, whose models would share the device
        steps += [
            ("SGLang release frees memory", lambda: release_check(probe(), args.min_release)),
            ("SGLang weight sync", lambda: sync_check(probe(), args.sync_tol, args.stale_ratio, groups()[0])),
        ]
    steps.append(
        (
            f"rollout engine held the update (iteration {ITERATIONS - 1})",
            lambda: check_not_stale(store, path, args.max_gap, args.stale_ratio, args.stale_rows),
        )
    )
    return steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="local model folder (Hugging Face layout)")
    parser.add_argument("--out", type=Path, default=Path("gpu-smoke"), help="config, store and MLflow go here")
    parser.add_argument("--report", type=Path, help="the JSON report, rewritten after every check (OUT/report.json)")
    parser.add_argument(
        "--sglang", action=argparse.BooleanOptionalAction, default=True, help="roll out with SGLang (default) or HF"
    )
    parser.add_argument(
        "--zero-stage", type=int, choices=(2, 3), default=2, help="DeepSpeed ZeRO stage (default 2, as the recipes)"
    )
    parser.add_argument("--lr", type=float, default=SMOKE_LR, help=f"learning rate (default {SMOKE_LR:g})")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds allowed for drmas run (default 1800)")
    parser.add_argument("--max-gap", type=float, default=0.1, help="largest mean |log-prob gap| (default 0.1)")
    parser.add_argument(
        "--stale-ratio", type=float, default=3.0, help="how much farther a stale policy must be (default 3)"
    )
    parser.add_argument("--stale-rows", type=int, default=32, help="rollout rows scored per worker group (32)")
    parser.add_argument("--sync-tol", type=float, default=1e-3, help="largest pushed/disk log-prob difference")
    parser.add_argument(
        "--min-release", type=float, default=0.8, help="share of an engine's memory its release frees (0.8)"
    )
    parser.add_argument("--dry-run", action="store_true", help="only write and validate the config")
    args = parser.parse_args(argv)
    out = args.out.resolve()
    report = (args.report or out / "report.json").resolve()
    meta = {
        "script": "bench/gpu_smoke.py",
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "args": {key: str(value) for key, value in vars(args).items()},
    }
    try:
        path = write_config(args.model.resolve(), args.sglang, out, args.zero_stage, args.lr)
    except Exception as error:  # drmas's ConfigError names the field; anything else is reported too
        invalid = Check("config valid", False, str(error))
        run_steps([(invalid.name, lambda: invalid)], report, meta)
        return 1
    print(f"config: {path}")
    meta["config"] = str(path)
    steps = [("config valid (drmas config)", lambda: check_config_cli(path))]
    checks = run_steps(steps if args.dry_run else smoke_steps(path, out, args), report, meta)
    failed = sum(not check.passed for check in checks)
    print(f"{len(checks) - failed} passed, {failed} failed; report: {report}")
    return failed


if __name__ == "__main__":
    raise SystemExit(main())
