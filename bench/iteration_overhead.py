"""Iteration overhead: the share of an RL iteration's wall time spent outside generation
and forward/backward, for ``drmas run`` (embedded) and ``drmas run --via kfp-local``.

    .venv/bin/python bench/iteration_overhead.py [--iterations 4] [--warmstart-steps 300]
    .venv/bin/python bench/iteration_overhead.py --modes embedded --iterations 3   # quicker

The default config (``configs/math_tiny.yaml``: Solver and Verifier, one ~1M-parameter model
each, 16 prompts x 8 samples, up to 2 Solver calls) with fewer iterations, no evaluation
(``eval.every=0``) and a shorter warm start. The warm start is done once, in this process,
and copied into every run (it is not part of an iteration). Each mode then runs as the
user would run it, as a subprocess: ``drmas run CONFIG --run-id ... [--via kfp-local]``.

Every Python process of those runs (the driver, Ray's actors, kfp.local's task processes)
times the engines' calls (``bench/common.py``: ``HFEngine.generate``, the update's
``_forward_backward`` = forward + backward, and the optimizer step) and the stages. Iteration i
is the time from the end of iteration i-1's checkpoint (for iteration 0: the end of the
warm start) to the end of iteration i's, so that everything in between counts (tracking,
cache keys, Ray, process start-up). Prints, per mode, the mean over iterations 1..N-1
(iteration 0 also pays for Ray's start; shown on its own):

    overhead = 1 - (generate + forward/backward + optimizer step) / iteration wall time

and what the overhead is made of. The default took about 11 minutes on 2 cores that other
jobs kept busy (load average ~6), 5 of them in the warm start; ``--warmstart-steps 100
--iterations 3`` is quicker (the shares hardly change).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from common import THREADS_HELP, busy, read_timings, timer_env

CONFIG = ROOT / "configs" / "math_tiny.yaml"
STAGES = ("stage/rollout", "stage/advantage", "stage/update", "stage/checkpoint")


def prepare_warm_start(overrides: list[str], run_ids: list[str]) -> tuple[float, str]:
    """Warm-start once (in this process) and copy the initial and warm-started policies
    into every run: deterministic given the config, so each run would compute the same."""
    from drmas.config import load_config
    from drmas.infra.layout import run_path
    from drmas.infra.store import Store
    from drmas.runner import open_run, starting_policies

    config = load_config(CONFIG, overrides)
    store = Store(config.store.root)
    open_run(config, store, "template", resume=False)
    started = time.perf_counter()
    starting_policies(config, store, "template")
    seconds = time.perf_counter() - started
    template = Path(config.store.root) / run_path(config.experiment.name, "template")
    for run_id in run_ids:
        target = Path(config.store.root) / run_path(config.experiment.name, run_id)
        for part in ("init", "warmstart"):
            if (template / part).exists():
                shutil.copytree(template / part, target / part)
    return seconds, config.experiment.name


def run_mode(mode: str, overrides: list[str], folder: Path, threads: int) -> tuple[float, int, Path]:
    """``drmas run`` as a subprocess with the timers on; returns wall seconds, its pid, the timings."""
    folder.mkdir(parents=True, exist_ok=True)
    timings = folder / "timings.jsonl"
    env = {
        **os.environ,
        **timer_env(timings, folder / "site", threads),
        "HF_HUB_OFFLINE": "1",
        "MLFLOW_DISABLE_TELEMETRY": "true",
    }
    via = ["--via", "kfp-local"] if mode == "kfp-local" else []
    command = [sys.executable, "-m", "drmas.cli", "run", str(CONFIG), "--run-id", mode, *via, *overrides]
    with open(folder / "output.log", "w") as log:
        started = time.perf_counter()
        process = subprocess.Popen(command, cwd=folder, env=env, stdout=log, stderr=subprocess.STDOUT)
        code = process.wait()
        seconds = time.perf_counter() - started
    if code != 0:
        sys.stdout.write((folder / "output.log").read_text()[-4000:])
        raise SystemExit(f"{mode}: drmas run exited {code} (log above)")
    return seconds, process.pid, timings


def windows(events: list[dict]) -> list[tuple[float, float]]:
    """(start, end) of every iteration: warm-start end -> checkpoint end -> checkpoint end ..."""
    ends = sorted(e["t1"] for e in events if e["name"] == "stage/checkpoint")
    warm = [e["t1"] for e in events if e["name"] == "warmstart"]
    if not ends or not warm:
        raise SystemExit("no checkpoint or warm-start timings were recorded: are the timers installed?")
    starts = [max(warm)] + ends[:-1]
    return list(zip(starts, ends, strict=True))


def breakdown(events: list[dict], start: float, end: float, driver: int) -> dict[str, float]:
    """Seconds of each part of one iteration window."""
    b = {name: busy(events, name, start, end) for name in {e["name"] for e in events}}
    get = lambda name: b.get(name, 0.0)  # noqa: E731
    parts = {
        "wall": end - start,
        "generate": get("generate"),
        "fwd_bwd": get("fwd_bwd"),
        "optimizer": get("optimizer_step"),
    }
    parts["compute"] = parts["generate"] + parts["fwd_bwd"] + parts["optimizer"]
    parts["rollout: policy reload in the actors"] = get("actor/load_policy")
    parts["rollout: Ray calls beyond generate/load (actor start, transfer, tokenise)"] = max(
        0.0, get("ray/generate_call") + get("ray/load_call") - parts["generate"] - get("actor/load_policy")
    )
    parts["rollout: rest (questions, episodes, Parquet)"] = max(
        0.0, get("stage/rollout") - get("ray/generate_call") - get("ray/load_call")
    )
    parts["update: load/save model and optimizer, read batch"] = max(
        0.0, get("stage/update") - parts["fwd_bwd"] - parts["optimizer"]
    )
    parts["advantage stage"] = get("stage/advantage")
    parts["checkpoint stage"] = get("stage/checkpoint")
    outside = parts["wall"] - sum(get(name) for name in STAGES)
    ray_start = get("ray/start") + get("ray/pool_start") + get("ray/shutdown")
    parts["between stages: Ray start/stop"] = ray_start
    tracking = {name.split("/", 1)[1]: seconds for name, seconds in b.items() if name.startswith("tracking/")}
    parts["between stages: MLflow tracking"] = sum(tracking.values())
    for method, seconds in tracking.items():
        parts[f"  of which Tracker.{method}"] = seconds
    parts["between stages: cache keys"] = get("cache_key")
    processes = [
        e
        for e in events
        if e["name"] == "process" and e["pid"] != driver and start <= e["t0"] < end and e["t1"] - e["t0"] > 0.5
    ]
    parts["task processes"] = float(len(processes))
    parts["between stages: rest (process start-up, imports, kfp, ...)"] = max(
        0.0, outside - ray_start - sum(tracking.values()) - get("cache_key")
    )
    return parts


def stored_metrics(store_root: Path, experiment: str, run_id: str) -> list[dict]:
    folder = store_root / experiment / run_id
    return [json.loads(p.read_text()) for p in sorted(folder.glob("iter-*/checkpoint/metrics.json"))]


def report(mode: str, seconds: float, driver: int, timings: Path, metrics: list[dict]) -> dict[str, float]:
    events = read_timings(timings)
    spans = windows(events)
    per_iteration = [breakdown(events, s, e, driver) for s, e in spans]
    steady = per_iteration[1:] if len(per_iteration) > 1 else per_iteration
    mean = {key: sum(p.get(key, 0.0) for p in steady) / len(steady) for key in {k for p in steady for k in p}}
    first = per_iteration[0]
    overhead = 1 - mean["compute"] / mean["wall"]
    print(f"\n== {mode}: drmas run took {seconds:.0f} s in all; {len(spans)} iterations")
    top = sorted(
        ((k, v) for k, v in first.items() if (":" in k or k.endswith("stage")) and not k.startswith("  ")),
        key=lambda kv: -kv[1],
    )[:3]
    print(
        f"iteration 0: {first['wall']:.1f} s, overhead {1 - first['compute'] / first['wall']:.0%}; most of it: "
        + ", ".join(f"{key} {value:.1f} s" for key, value in top)
    )
    label = f"iterations 1..{len(spans) - 1}" if len(spans) > 1 else "iteration 0"
    print(
        f"{label} (mean): {mean['wall']:.1f} s; generate {mean['generate']:.2f} s, "
        f"forward/backward {mean['fwd_bwd']:.2f} s, "
        f"optimizer {mean['optimizer']:.2f} s -> OVERHEAD {overhead:.0%}"
    )
    print("  where the overhead goes (s per iteration, share of the iteration):")
    rest = [(k, v) for k, v in mean.items() if (":" in k or k.endswith("stage")) and not k.startswith("  ")]
    for key, value in sorted(rest, key=lambda kv: -kv[1]):
        print(f"    {value:6.2f} s {value / mean['wall']:5.1%}  {key}")
        if key == "between stages: MLflow tracking":
            for sub, seconds in sorted(
                ((k, v) for k, v in mean.items() if k.startswith("  of which") and v > 0.005), key=lambda kv: -kv[1]
            ):
                print(f"    {seconds:6.2f} s {seconds / mean['wall']:5.1%}  {sub}")
    if mean["task processes"]:
        print(f"  task processes started per iteration: {mean['task processes']:.0f}")
    run_span = (spans[0][0], spans[-1][1])
    driver_life = next((e for e in events if e["name"] == "process" and e["pid"] == driver), None)
    if driver_life is not None:
        print(
            f"  whole command: {driver_life['t1'] - driver_life['t0']:.1f} s = "
            f"before iteration 0 {run_span[0] - driver_life['t0']:.1f} s "
            f"(start-up, config, warm start reused) + iterations {run_span[1] - run_span[0]:.1f} s + "
            f"after {driver_life['t1'] - run_span[1]:.1f} s "
            "(report, model registry, shutdown)"
        )
    if metrics:
        keys = sorted(
            {k for m in metrics for k in m if k.startswith("time/") or (k.startswith("wg/") and k.endswith("/time"))}
        )
        steady_metrics = metrics[1:] if len(metrics) > 1 else metrics
        shown = ", ".join(f"{k} {sum(m.get(k, 0.0) for m in steady_metrics) / len(steady_metrics):.2f}" for k in keys)
        print(f"  drmas's own timings (checkpoint metrics.json, mean of the same iterations): {shown}")
    return {"overhead": overhead, "wall": mean["wall"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--iterations", type=int, default=4, help="RL iterations per mode (iteration 0 is reported apart)"
    )
    parser.add_argument("--warmstart-steps", type=int, default=300, help="warm-start steps (done once, not timed)")
    parser.add_argument("--modes", default="embedded,kfp-local", help="comma-separated: embedded, kfp-local")
    parser.add_argument("--threads", type=int, default=1, help=THREADS_HELP)
    parser.add_argument("overrides", nargs="*", help="more config overrides, section.field=value")
    args = parser.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # also in the warm start's worker processes
    scratch = Path(tempfile.mkdtemp(prefix="drmas-overhead-"))
    try:
        overrides = [
            f"experiment.iterations={args.iterations}",
            f"warmstart.steps={args.warmstart_steps}",
            "eval.every=0",
            f"store.root={scratch / 'store'}",
            *args.overrides,
        ]
        print(
            f"load average at start: {' '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} cores "
            "(other processes on the machine inflate every part; the shares are what to read)"
        )
        if args.threads > 0:
            import torch

            torch.set_num_threads(args.threads)
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
        warm_s, experiment = prepare_warm_start(overrides, modes)
        print(f"warm start ({args.warmstart_steps} steps, once, copied into each run): {warm_s:.0f} s")
        results = {}
        for mode in modes:
            seconds, pid, timings = run_mode(mode, overrides, scratch / mode, args.threads)
            results[mode] = report(mode, seconds, pid, timings, stored_metrics(scratch / "store", experiment, mode))
        if len(results) == 2:
            emb, kfp = results["embedded"], results["kfp-local"]
            print(
                f"\niteration wall time kfp-local / embedded: {kfp['wall'] / emb['wall']:.2f}x; "
                f"overhead embedded {emb['overhead']:.0%}, kfp-local {kfp['overhead']:.0%}"
            )
        print(f"load average at end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
