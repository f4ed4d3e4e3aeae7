"""The embedded runner: the whole training loop on one machine, one screen long.

Each iteration calls the same stage functions that the Kubeflow components call. A stage
whose output artifact is already complete is not run again (stages are deterministic given
their inputs, so its output is what a rerun would produce), which is what makes a killed
run resumable: ``train`` continues after the last checkpointed iteration.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from drmas.advantage import advantage
from drmas.checkpoint import checkpoint, resume_point
from drmas.evaluate import evaluate
from drmas.config import ConfigError, DrmasConfig
from drmas.layout import StageResult, optim_path, policy_path, run_path, stage_path
from drmas.policies import init_policies
from drmas.rollout import rollout
from drmas.store import Store
from drmas.update import update
from drmas.warmstart import warmstart
from drmas.workers import PolicyRef

__all__ = ["RunSummary", "open_run", "train"]

log = logging.getLogger("drmas")


@dataclass(frozen=True)
class RunSummary:
    run_id: str
    iterations_run: int
    last_iteration: int
    metrics: dict[str, float]


def open_run(config: DrmasConfig, store: Store, run_id: str, resume: bool) -> DrmasConfig:
    """Record a new run's resolved config, or check a resumed run's against the record.

    Only ``experiment.iterations`` may change on resume (to extend a run); anything else
    would make the resumed run a different run, so it is refused with the fields named.
    """
    path = f"{run_path(config.experiment.name, run_id)}/run"
    if not store.exists(path):
        if resume:
            raise ConfigError([f"cannot resume run {run_id!r}: nothing at {store.uri(path)}"])
        with store.writer(path, meta={"stage": "run"}) as out:
            out.write_bytes("config.json", config.to_json(indent=2).encode())
        return config
    if not resume:
        raise ConfigError([f"run {run_id!r} already exists at {store.uri(path)}; pass --resume to continue it"])
    recorded = DrmasConfig.from_json(store.open(path).read_bytes("config.json").decode())
    theirs = recorded.flat_params()
    ours = config.flat_params()
    changed = sorted(k for k in theirs.keys() | ours.keys() if theirs.get(k) != ours.get(k) and k != "experiment.iterations")
    if changed:
        raise ConfigError([f"{key}: the run was started with {theirs.get(key)}, now {ours.get(key)}" for key in changed])
    return config


def _done_or(store: Store, path: str, run) -> StageResult:
    """Reuse a complete stage output (its metrics), or run the stage."""
    if store.exists(path):
        artifact = store.open(path)
        metrics = artifact.read_json("metrics.json") if "metrics.json" in artifact.files else {}
        return StageResult(path, metrics)
    return run()


def train(config: DrmasConfig, store: Store, run_id: str, cache_dir: Path | None = None, config_path: str | None = None) -> RunSummary:
    """Train from the last complete iteration to ``experiment.iterations``.

    Per iteration: rollout, advantage, update per worker group, evaluate (when due), then
    the checkpoint that commits it. Metrics go to MLflow with ``step`` = the number of
    completed iterations (step 0 is the evaluation before training).
    """
    from drmas.pool import RayPool, connect_ray  # noqa: PLC0415 - Ray only when training
    from drmas.tracking import Tracker  # noqa: PLC0415

    experiment, total = config.experiment.name, config.experiment.iterations
    start = resume_point(config, store, run_id)
    if start.next_iteration >= total:
        log.info("run %s: all %d iterations are complete; nothing left to do", run_id, total)
        return RunSummary(run_id, 0, start.next_iteration - 1, {})
    tracker = Tracker(config, run_id, store.root, config_path)
    log.info("tracking: %s", tracker.url)
    initial = init_policies(config, store, run_id)
    if config.warmstart.steps:
        initial = warmstart(config, store, run_id, initial)
    reference = initial  # the KL anchor, and what "before training" evaluates
    policies = initial if start.next_iteration == 0 else start.policies
    optims = start.optims
    groups = [group.name for group in config.worker_groups()]
    started_ray = connect_ray(config, cache_dir / "ray" if cache_dir else None)
    metrics: dict[str, float] = {}
    try:
        with RayPool(config, store, cache_dir=cache_dir / "policies" if cache_dir else None) as pool:
            if config.eval.every and start.next_iteration == 0:
                before = _done_or(store, f"{run_path(experiment, run_id)}/init/evaluate", lambda: evaluate(config, store, f"{run_path(experiment, run_id)}/init/evaluate", reference, pool))
                tracker.log_metrics(before.metrics, step=0)
                log.info("before training: %s", _eval_line(before.metrics, config.eval.k))
            for i in range(start.next_iteration, total):
                began = time.perf_counter()
                stages = {"rollout": stage_path(experiment, run_id, i, "rollout"), "advantage": stage_path(experiment, run_id, i, "advantage")}
                metrics = _done_or(store, stages["rollout"], lambda: rollout(config, store, run_id, i, policies, pool)).metrics.copy()
                metrics |= _done_or(store, stages["advantage"], lambda: advantage(config, store, run_id, i)).metrics
                for wg in groups:
                    stages[f"policy/{wg}"] = policy_path(experiment, run_id, i, wg)
                    stages[f"optim/{wg}"] = optim_path(experiment, run_id, i, wg)
                    metrics |= _done_or(
                        store,
                        stages[f"policy/{wg}"],
                        lambda: update(config, store, run_id, i, wg, policies[wg], optims[wg], reference[wg], overwrite=True),
                    ).metrics
                policies = {wg: PolicyRef(stages[f"policy/{wg}"]) for wg in groups}
                optims = {wg: PolicyRef(stages[f"optim/{wg}"]) for wg in groups}
                if config.eval.every and ((i + 1) % config.eval.every == 0 or i == total - 1):
                    stages["evaluate"] = stage_path(experiment, run_id, i, "evaluate")
                    metrics |= _done_or(store, stages["evaluate"], lambda: evaluate(config, store, stages["evaluate"], policies, pool, overwrite=True)).metrics
                metrics["time/iteration"] = time.perf_counter() - began
                stages["checkpoint"] = checkpoint(config, store, run_id, i, metrics).artifact
                tracker.log_metrics(metrics, step=i + 1)
                tracker.log_lineage(i, {stage: store.uri(path) for stage, path in stages.items()})
                log.info(_summary_line(i, metrics, config.eval.k))
    except BaseException:
        tracker.finish("KILLED")
        raise
    finally:
        if started_ray:
            import ray  # noqa: PLC0415

            ray.shutdown()
    tracker.finish()
    if tracker.gaps:
        log.warning("tracking: %d MLflow call(s) failed during the run; the store holds every result", tracker.gaps)
    return RunSummary(run_id, total - start.next_iteration, total - 1, metrics)


def _eval_line(metrics: dict[str, float], k: int) -> str:
    return f"eval avg@{k} {metrics.get(f'eval/avg_at_{k}', float('nan')):.3f} pass@{k} {metrics.get(f'eval/pass_at_{k}', float('nan')):.3f}"


def _summary_line(iteration: int, metrics: dict[str, float], k: int) -> str:
    agents = sorted({key.split("/")[1] for key in metrics if key.startswith("agent/") and key.endswith("/reward_mean")})
    per_agent = " ".join(f"{a}={metrics[f'agent/{a}/reward_mean']:.3f}" for a in agents)
    return (
        f"iter {iteration}: reward {metrics.get('reward/mean', float('nan')):.3f} [{per_agent}] "
        f"rollout {metrics.get('time/rollout', 0):.1f}s iteration {metrics['time/iteration']:.1f}s"
        + (f" | {_eval_line(metrics, k)}" if f"eval/avg_at_{k}" in metrics else "")
    )
