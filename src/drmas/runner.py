"""The embedded runner: the whole training loop on one machine, one screen long.

Each iteration calls the same stage functions that the Kubeflow components call, with
the same stage contracts (``drmas.stages.contracts``). A stage whose output already exists with
the same cache key (its inputs' content, the config it reads, the code that computes it) is not run
again; stages are deterministic given their inputs, so that output is what a rerun would
produce. This makes a killed run resumable (``train`` continues after the last
checkpointed iteration, reusing the stages of the interrupted one that had finished) and
lets ``rerun`` recompute a single stage.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from drmas.analysis.report import as_final
from drmas.config import ConfigError, DrmasConfig, resolve
from drmas.generation.pool import PoolOnDemand
from drmas.infra.layout import (
    METRICS_FILE,
    PolicyRef,
    StageResult,
    current_update,
    init_home,
    iteration_path,
    run_record_path,
    stage_path,
)
from drmas.infra.lease import RunLease
from drmas.infra.progress import Progress
from drmas.infra.store import Store
from drmas.stages.advantage import advantage
from drmas.stages.checkpoint import checkpoint, resume_point, training_metrics
from drmas.stages.contracts import (
    RETRIEVAL_SERVICE_FIELDS,
    AdvantageContract,
    CheckpointContract,
    EvaluateContract,
    RolloutContract,
    StageContract,
    UpdateContract,
    cache_key,
    evaluation_config,
    reuses,
)
from drmas.stages.evaluate import evaluate
from drmas.stages.iteration import FINAL, Step, iteration_steps
from drmas.stages.policies import init_policies
from drmas.stages.rollout import rollout
from drmas.stages.track import RunSummary, eval_line, finish_run, log_iteration, log_question_sets, summary_line
from drmas.stages.update import OptimizerStateLost, update
from drmas.stages.warmstart import warmstart
from drmas.tasks import run_length

__all__ = ["IterationResult", "open_run", "rerun", "run_iteration", "train"]

log = logging.getLogger("drmas")


MAX_ROLLBACKS = 3
"""How often a run goes back to its last stored optimizer state (its pool lost one held
in memory) before it gives up."""


def open_run(config: DrmasConfig, store: Store, run_id: str, resume: bool) -> DrmasConfig:
    """Record a new run's resolved config, or check a resumed run's against the record.

    A config whose ``experiment.epochs`` is not resolved yet is resolved first (its
    training set read to count them): the recorded config holds the run's iterations.
    Only the run's length (``experiment.iterations``, ``experiment.epochs``) may change on
    resume (to extend a run), and where the
    run is stored and tracked (``store.*``, ``tracking.*``: a store moved or reached through
    another endpoint is the same run) and its search served (``task.retrieval_url`` and
    its client settings: the service checks that it serves the same corpus); anything else would make the resumed run a
    different run, so it is refused with the fields named.
    """
    if config.experiment.iterations is None:
        config = run_length(config)
    path = run_record_path(config.experiment.name, run_id)
    if not store.exists(path):
        if resume:
            raise ConfigError([f"cannot resume run {run_id!r}: nothing at {store.uri(path)}"])
        with store.writer(path, meta={"stage": "run"}) as out:
            out.write_bytes("config.json", config.to_json(indent=2).encode())
        return config
    if not resume:
        raise ConfigError([f"run {run_id!r} already exists at {store.uri(path)}; pass --resume to continue it"])
    # A run recorded before the task's defaults were written into its config gets them now.
    recorded = resolve(DrmasConfig.from_json(store.open(path).read_bytes("config.json").decode()))
    theirs = recorded.flat_params()
    ours = config.flat_params()
    changed = sorted(
        k for k in theirs.keys() | ours.keys() if theirs.get(k) != ours.get(k) and not _may_change_on_resume(k)
    )
    if changed:
        raise ConfigError(
            [f"{key}: the run was started with {theirs.get(key)}, now {ours.get(key)}" for key in changed]
        )
    return config


def _may_change_on_resume(key: str) -> bool:
    """The run's length, where it is stored and tracked, and where its search is served."""
    return key in ("experiment.iterations", "experiment.epochs", *RETRIEVAL_SERVICE_FIELDS) or key.startswith(
        ("store.", "tracking.")
    )


@dataclass
class IterationResult:
    metrics: dict[str, float]
    stages: dict[str, str]
    """Stage name -> artifact path (lineage)."""
    policies: dict[str, PolicyRef]
    optims: dict[str, PolicyRef | None]
    recomputed: list[str]
    """The steps that were computed; the others were reused."""
    ran: list[str]
    """Every step, computed or reused, in the order it ran (``drmas.stages.iteration``)."""


def starting_policies(config: DrmasConfig, store: Store, run_id: str) -> dict[str, PolicyRef]:
    """The policies iteration 0 starts from (and the KL anchor): initial, then warm-started."""
    initial = init_policies(config, store, run_id)
    return warmstart(config, store, run_id, initial) if config.warmstart.steps else initial


def run_iteration(
    config: DrmasConfig,
    store: Store,
    run_id: str,
    i: int,
    policies: dict[str, PolicyRef],
    optims: dict[str, PolicyRef | None],
    reference: dict[str, PolicyRef],
    pool: PoolOnDemand,
    force: frozenset[str] = frozenset(),
) -> IterationResult:
    """The steps of iteration ``i`` as ``drmas.stages.iteration`` defines them, in its order:
    rollout, advantage, update per worker group, checkpoint, evaluate (when due).

    Each step runs only when the stage may not be reused (``drmas.stages.contracts.reuses``),
    or when ``force`` names it (its stage, e.g. ``update``, or the step, ``update/solver``).
    """
    out = IterationResult({}, {}, {}, {}, [], [])
    steps = iteration_steps(config, i)
    progress = Progress(len(steps), f"iteration {i}", unit="stage", final_line=False)  # the summary line follows
    for step in steps:
        contract, compute = _stage_call(step, config, store, run_id, policies, optims, reference, pool, out)
        key = cache_key(config, store, contract)
        metrics: dict[str, float] = {}
        if step.name in force or step.stage in force or not reuses(config, store, contract, key):
            metrics = compute(key).metrics
            out.recomputed.append(step.name)
        path = contract.stored_output(config, store)  # an update computed again: its new version
        if step.name not in out.recomputed and METRICS_FILE in store.open(path).files:
            metrics = store.open(path).read_json(METRICS_FILE)
        out.metrics.update(as_final(metrics) if step.variant == FINAL else metrics)
        out.ran.append(step.name)
        if step.stage == "update":
            assert isinstance(contract, UpdateContract) and step.wg is not None
            out.stages[f"policy/{step.wg}"] = path
            out.stages[f"optim/{step.wg}"] = contract.stored_optim_output(config, store)
            out.policies[step.wg] = PolicyRef(path)
            out.optims[step.wg] = PolicyRef(out.stages[f"optim/{step.wg}"])
        else:
            out.stages[step.name] = path
        progress.update(done=step.name)
    progress.close()
    return out


def _stage_call(
    step: Step,
    config: DrmasConfig,
    store: Store,
    run_id: str,
    policies: dict[str, PolicyRef],
    optims: dict[str, PolicyRef | None],
    reference: dict[str, PolicyRef],
    pool: PoolOnDemand,
    out: IterationResult,
) -> tuple[StageContract, Callable[[str], StageResult]]:
    """The contract of ``step`` and the call that computes it with a cache key: each stage's
    arguments, read from the iteration's inputs and the steps before it (``out``)."""
    i = step.iteration
    if step.stage == "rollout":
        return RolloutContract(run_id, i, policies), lambda key: rollout(
            config, store, run_id, i, policies, pool(), overwrite=True, cache_key=key
        )
    if step.stage == "advantage":
        return AdvantageContract(run_id, i), lambda key: advantage(
            config, store, run_id, i, overwrite=True, cache_key=key
        )
    if step.stage == "update":
        wg = step.wg or ""
        update_call = UpdateContract(run_id, i, wg, policies[wg], optims[wg], reference[wg])
        return update_call, lambda key: update(
            config,
            store,
            run_id,
            i,
            wg,
            policies[wg],
            optims[wg],
            reference[wg],
            overwrite=True,
            cache_key=key,
            pool=pool(),
        )
    if step.stage == "checkpoint":
        return CheckpointContract(run_id, i), lambda key: checkpoint(
            config, store, run_id, i, training_metrics(config, store, run_id, i), overwrite=True, cache_key=key
        )
    if step.stage == "evaluate":
        label = step.variant or "evaluate"
        home = iteration_path(config.experiment.name, run_id, i)
        evaluation = EvaluateContract(home, dict(out.policies), label)
        return evaluation, lambda key: evaluate(
            evaluation_config(config, label),
            store,
            evaluation.output(config),
            evaluation.policies,
            pool(),
            overwrite=True,
            cache_key=key,
        )
    raise ValueError(f"{step.title}: no stage {step.stage!r} in an iteration")


def _holding_the_run(function):
    """Run ``function(config, store, run_id, ...)`` holding the run's lease: one writer per
    run (drmas.infra.lease); a second is refused with RunBusy naming the holder, and every
    write of this process checks the lease first."""

    @functools.wraps(function)
    def holding(config: DrmasConfig, store: Store, run_id: str, *args, **kwargs):
        with RunLease(store, config.experiment.name, run_id):
            return function(config, store, run_id, *args, **kwargs)

    return holding


@_holding_the_run
def train(
    config: DrmasConfig, store: Store, run_id: str, cache_dir: Path | None = None, config_path: str | None = None
) -> RunSummary:
    """Train from the last complete iteration to ``experiment.iterations``.

    Metrics go to MLflow with ``step`` = the number of completed iterations (step 0 is the
    evaluation before training).
    """
    from drmas.infra.tracking import Tracker  # noqa: PLC0415

    experiment, total = config.experiment.name, config.total_iterations
    start = resume_point(config, store, run_id)
    if start.next_iteration >= total:
        log.info("run %s: all %d iterations are complete; nothing left to do", run_id, total)
        return RunSummary(run_id, 0, start.next_iteration - 1, {})
    tracker = Tracker(config, run_id, store.root, config_path)
    log.info("tracking: %s", tracker.where(config.tracking.ui_url))
    metrics: dict[str, float] = {}
    before: dict[str, float] = {}
    last_checkpoint = ""
    try:
        if start.next_iteration == 0:
            log_question_sets(config, tracker)
        initial = starting_policies(config, store, run_id)
        policies = initial if start.next_iteration == 0 else start.policies
        optims = start.optims
        with PoolOnDemand(config, store, cache_dir, run=(experiment, run_id)) as pool:
            if config.eval.every and start.next_iteration == 0:
                evaluation = EvaluateContract(init_home(experiment, run_id), initial)
                path, key = evaluation.output(config), cache_key(config, store, evaluation)
                before = (
                    store.open(path).read_json(METRICS_FILE)
                    if reuses(config, store, evaluation, key)
                    else evaluate(config, store, path, initial, pool(), overwrite=True, cache_key=key).metrics
                )
                tracker.log_metrics(before, step=0)
                log.info("before training: %s", eval_line(before, config.eval.k))
            i, rollbacks = start.next_iteration, 0
            while i < total:
                try:
                    result = run_iteration(config, store, run_id, i, policies, optims, initial, pool)
                except OptimizerStateLost as lost:
                    rollbacks += 1
                    if rollbacks > MAX_ROLLBACKS:
                        raise
                    back = resume_point(config, store, run_id)
                    log.warning(
                        "iteration %d: %s; going back to iteration %d, after the last stored optimizer state",
                        i,
                        lost,
                        back.next_iteration,
                    )
                    i, optims = back.next_iteration, back.optims
                    policies = initial if i == 0 else back.policies
                    continue
                policies, optims, metrics = result.policies, result.optims, result.metrics
                log_iteration(tracker, store, i, metrics, result.stages)
                last_checkpoint = store.uri(result.stages["checkpoint"])
                log.info(summary_line(i, metrics, config.eval.k))
                i += 1
            pool.release()  # the run is complete: its pool goes
    except BaseException:
        tracker.finish("KILLED")
        raise
    link = tracker.where(config.tracking.ui_url)
    summary = RunSummary(run_id, total - start.next_iteration, total - 1, metrics, before, link, last_checkpoint)
    finish_run(config, store, run_id, tracker, summary, {wg: ref.artifact for wg, ref in policies.items()})
    return summary


@_holding_the_run
def rerun(
    config: DrmasConfig, store: Store, run_id: str, iteration: int, stage_name: str, cache_dir: Path | None = None
) -> IterationResult:
    """Recompute ``stage_name`` (a stage of ``drmas.stages.iteration``, or one step of it:
    ``update/WG``) of a checkpointed iteration from its stored inputs; the stages after it
    in that iteration recompute only if their inputs changed (cache keys)."""
    experiment = config.experiment.name
    steps = iteration_steps(config, iteration)
    if stage_name not in {step.stage for step in steps} | {step.name for step in steps}:
        raise ValueError(
            f"iteration {iteration} has no stage {stage_name!r}; its stages: "
            f"{', '.join(dict.fromkeys(step.stage for step in steps))} "
            f"(or one step: {', '.join(step.name for step in steps)})"
        )
    if not store.exists(stage_path(experiment, run_id, iteration, "checkpoint")):
        raise ValueError(f"run {run_id} has no checkpoint for iteration {iteration}: nothing to rerun")
    groups = [group.name for group in config.worker_groups()]
    if iteration > 0:
        current = {wg: current_update(store, experiment, run_id, iteration - 1, wg) for wg in groups}
        policies = {wg: PolicyRef(policy) for wg, (policy, _) in current.items()}
        optims = {wg: PolicyRef(optim) for wg, (_, optim) in current.items()}
        if stage_name != "checkpoint" and not all(store.exists(ref.artifact) for ref in optims.values()):
            raise ValueError(
                f"run {run_id}: the optimizer state of iteration {iteration - 1}, which the update of iteration "
                f"{iteration} starts from, is not in the store (stored every checkpoint.every "
                f"{config.checkpoint.every}-th iteration, the last checkpoint.keep {config.checkpoint.keep} kept): "
                f"iteration {iteration} cannot be rerun"
            )
    initial = starting_policies(config, store, run_id)
    if iteration == 0:
        policies, optims = initial, {wg: None for wg in groups}
    with PoolOnDemand(config, store, cache_dir, run=(experiment, run_id)) as pool:
        return run_iteration(
            config, store, run_id, iteration, policies, optims, initial, pool, force=frozenset({stage_name})
        )
