"""Settings and helpers shared by the benchmarks.

Timers across processes (``trl_side_by_side.py``, ``iteration_overhead.py``): drmas runs
generation in Ray actors and, with ``--via kfp-local``, every stage in a subprocess, so
timing from the driver alone cannot split an iteration into compute and the rest.
``install_timers(path)`` wraps a fixed list of drmas functions (``TIMED``) so that every
call appends one JSON line ``{"name", "pid", "t0", "t1"}`` (wall-clock seconds) to
``path``; ``timer_env(path, folder)`` returns the environment that makes every Python
process started with it (Ray workers, ``drmas run``, kfp.local tasks) do the same, through
a ``sitecustomize`` module written into ``folder``. Nothing in the library changes.
"""

from __future__ import annotations

import atexit
import functools
import importlib.abc
import json
import os
import sys
import time
from pathlib import Path

MODEL_20M = [
    "models.tiny.hidden_size=512",
    "models.tiny.intermediate_size=1536",
    "models.tiny.num_layers=6",
    "models.tiny.num_heads=8",
    "models.tiny.num_kv_heads=4",
]
"""Overrides that make the `tiny` model of the shipped configs a ~19M-parameter model."""

TIMED: dict[str, list[tuple[str, str]]] = {
    "drmas.generation.engines.hf": [("HFEngine.generate", "generate")],
    "drmas.stages.update": [("update", "stage/update")],
    "drmas.training.loop": [("_forward_backward", "fwd_bwd")],
    "drmas.training.engines.torch": [("TorchEngine.step", "optimizer_step")],
    "drmas.training.engines.deepspeed": [("DeepSpeedEngine.step", "optimizer_step")],
    "drmas.stages.rollout": [("rollout", "stage/rollout")],
    "drmas.stages.advantage": [("advantage", "stage/advantage")],
    "drmas.stages.checkpoint": [("checkpoint", "stage/checkpoint")],
    "drmas.stages.evaluate": [("evaluate", "stage/evaluate")],
    "drmas.stages.warmstart": [("warmstart", "warmstart")],
    "drmas.generation.workers": [("WorkerGroupRuntime.load_policy", "actor/load_policy")],
    "drmas.models": [("load_model", "load_model")],
    "drmas.generation.ray_session": [("connect_ray", "ray/start")],
    "drmas.generation.pool": [
        ("RayPool.__init__", "ray/pool_start"),
        ("RayPool.close", "ray/pool_close"),
        ("RayPool.load", "ray/load_call"),
        ("RayPool.generate", "ray/generate_call"),
        ("PoolOnDemand.__exit__", "ray/shutdown"),
    ],
    "drmas.stages.track": [("finish_run", "report")],
    "drmas.stages.contracts": [("cache_key", "cache_key")],
    "drmas.infra.tracking": [
        ("Tracker.__init__", "tracking/init"),
        ("Tracker.log_metrics", "tracking/log_metrics"),
        ("Tracker.log_lineage", "tracking/log_lineage"),
        ("Tracker.log_episodes", "tracking/log_episodes"),
        ("Tracker.log_dataset", "tracking/log_dataset"),
        ("Tracker.log_files", "tracking/log_files"),
        ("Tracker.register_policies", "tracking/register_policies"),
        ("Tracker.finish", "tracking/finish"),
    ],
}
"""Module -> (attribute, event name): the drmas functions whose calls are timed."""

TIMERS_ENV = "DRMAS_BENCH_TIMINGS"
THREADS_ENV = "DRMAS_BENCH_THREADS"
"""When set (with the timers), drmas's rollout workers use this many torch threads instead
of the number of cores (``WorkerGroupRuntime``'s ``threads``)."""


def _emit(path: str, name: str, t0: float, t1: float) -> None:
    line = json.dumps({"name": name, "pid": os.getpid(), "t0": t0, "t1": t1}) + "\n"
    try:
        with open(path, "a") as out:  # one short append per event: safe across processes
            out.write(line)
    except OSError:
        pass  # the benchmark is over and its folder gone


def _wrap(function, name: str, path: str):
    if getattr(function, "_bench_timed", False):
        return function

    @functools.wraps(function)
    def timed(*args, **kwargs):
        t0 = time.time()
        try:
            return function(*args, **kwargs)
        finally:
            _emit(path, name, t0, time.time())

    timed._bench_timed = True
    return timed


def _patch(module, targets: list[tuple[str, str]], path: str) -> None:
    for dotted, name in targets:
        owner, _, attribute = dotted.rpartition(".")
        holder = getattr(module, owner, None) if owner else module
        if holder is None or not hasattr(holder, attribute):  # renamed in drmas: say so, import on
            print(f"bench timers: {module.__name__}.{dotted} not found, not timed", file=sys.stderr)
            continue
        setattr(holder, attribute, _wrap(getattr(holder, attribute), name, path))
    if module.__name__ == "drmas.generation.workers" and os.environ.get(THREADS_ENV):
        _limit_worker_threads(module.WorkerGroupRuntime, int(os.environ[THREADS_ENV]))


def _limit_worker_threads(runtime, threads: int) -> None:
    init = runtime.__init__
    if getattr(init, "_bench_threads", False):
        return

    @functools.wraps(init)
    def limited(self, *args, **kwargs):
        kwargs["threads"] = threads
        init(self, *args, **kwargs)

    limited._bench_threads = True
    runtime.__init__ = limited


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches a module of ``TIMED`` right after it executes, before anyone imports from it."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.resolving: set[str] = set()

    def find_spec(self, fullname, search_path, target=None):
        if fullname not in TIMED or fullname in self.resolving:
            return None  # (another finder that delegates may ask again: answer once)
        self.resolving.add(fullname)
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, search_path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            self.resolving.discard(fullname)
        loader, path = spec.loader, self.path
        original = loader.exec_module

        def exec_module(module):
            original(module)
            _patch(module, TIMED[fullname], path)

        loader.exec_module = exec_module
        return spec


def _process_start() -> float:
    """When this process started (wall clock), from /proc; now if unavailable."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(
            float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime")
        )
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, StopIteration, IndexError):
        return time.time()


def install_timers(path: str | Path) -> None:
    """Time the ``TIMED`` functions in this process: those of modules already imported
    now (call this before importing what uses them), the others when they are imported.
    The process's own life is one ``process`` event, written at exit."""
    path = str(path)
    if any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        return
    for name, targets in TIMED.items():
        if name in sys.modules:
            _patch(sys.modules[name], targets, path)
    sys.meta_path.insert(0, _PatchOnImport(path))
    started = _process_start()
    atexit.register(lambda: _emit(path, "process", started, time.time()))


SITECUSTOMIZE = """\
# Written by bench/common.py: times drmas functions in every Python process of a benchmark.
try:
    import importlib.util as _util, os as _os
    _spec = _util.spec_from_file_location("drmas_bench_timers", {common!r})
    _module = _util.module_from_spec(_spec)
    _spec.loader.exec_module(_module)
    _module.install_timers(_os.environ[{env!r}])
except Exception as _error:  # never break a process for a timer
    import sys as _sys
    print(f"bench timers not installed: {{_error}}", file=_sys.stderr)
"""


def timer_env(path: str | Path, folder: str | Path, threads: int = 0) -> dict[str, str]:
    """Environment for subprocesses (and Ray workers: set it before Ray starts) whose
    Python processes install the timers, writing to ``path``. ``threads`` > 0 also pins
    every process's torch threads (``OMP_NUM_THREADS``, and the rollout workers' own
    setting); 0 leaves drmas's choice (all cores)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE.format(common=str(Path(__file__).resolve()), env=TIMERS_ENV))
    python_path = os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH", "")) if p)
    env = {TIMERS_ENV: str(path), "PYTHONPATH": python_path}
    if threads > 0:
        env |= {THREADS_ENV: str(threads), "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    return env


THREADS_HELP = (
    "torch threads of every process (both trainers, drmas's Ray actors); 0: drmas's own choice "
    "(all cores). On a machine that other jobs load, 2 threads on 2 cores made a small model's "
    "steps up to ~20x slower (OpenMP threads wait for a descheduled peer), so 1 is the default"
)


def read_timings(path: str | Path) -> list[dict]:
    """The events written so far (an unfinished last line, if any, is skipped)."""
    events = []
    if Path(path).exists():
        for line in Path(path).read_text().splitlines():
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return events


def busy(events: list[dict], name: str, start: float, end: float) -> float:
    """Seconds that events called ``name`` spent inside [start, end] (clipped; nested or
    concurrent calls of one name are counted once, as their union)."""
    spans = sorted((max(e["t0"], start), min(e["t1"], end)) for e in events if e["name"] == name)
    total, reach = 0.0, start
    for t0, t1 in spans:
        t0 = max(t0, reach)
        if t1 > t0:
            total += t1 - t0
            reach = t1
    return total
