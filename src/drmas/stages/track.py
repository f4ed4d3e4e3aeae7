"""What a run logs to MLflow, written once for the embedded runner and the Kubeflow
pipeline's tracking steps (``drmas_kfp.components.track``), so that both give the same
MLflow run: params, ``step`` = completed iterations, lineage, datasets, episodes tables,
report figures and registered policies (docs/architecture.md §8).

    log_question_sets(config, tracker)                    train and eval sets as dataset inputs
    log_iteration(tracker, store, i, metrics, stages)     step i + 1: metrics, lineage, episodes
    finish_run(tracker, config, store, run_id, summary)    report, registered policies, run ended

The embedded runner logs as it trains. A Kubeflow run logs from small CPU steps that read
what the stages stored (``stored_iteration``): one at the start (it opens the MLflow run and
tags it with the KFP run id and the image), one after each iteration's checkpoint (and
evaluation), one at the end (report, models). Those steps never fail the pipeline:
tracking is a view of the store, which holds every result.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from drmas.analysis.report import FINAL_PREFIX, History, iteration_metrics, run_history, write_report
from drmas.config import DrmasConfig
from drmas.infra.layout import (
    current_update,
    evaluation_path,
    init_home,
    iteration_path,
    report_path,
    run_path,
    stage_path,
)
from drmas.infra.store import Store
from drmas.stages.contracts import EvaluateContract
from drmas.tasks import task_for

if TYPE_CHECKING:
    from drmas.infra.tracking import Tracker

__all__ = [
    "SAMPLE_CALLS",
    "TRACKING_FILE",
    "RunSummary",
    "finish_run",
    "log_iteration",
    "log_question_sets",
    "track_end",
    "track_iteration",
    "track_start",
    "stored_iteration",
    "summary_line",
    "summary_table",
]

log = logging.getLogger("drmas")

SAMPLE_CALLS = 16
"""Agent calls per iteration shown in MLflow's episodes table."""
TRACKING_FILE = "tracking.json"
"""In the run's report folder: where its MLflow run is (for a reader of the store)."""


@dataclass
class RunSummary:
    run_id: str
    iterations_run: int
    last_iteration: int
    metrics: dict[str, float]
    before: dict[str, float] = field(default_factory=dict)
    """Evaluation of the starting policies (empty when the run was resumed or has no eval)."""
    tracking: str = ""
    """Where the MLflow run is, for a person: its link (``Tracker.where``)."""
    checkpoint: str = ""
    report: str = ""


def log_question_sets(config: DrmasConfig, tracker: Tracker) -> None:
    """The train and eval question sets as MLflow dataset inputs (source and digest)."""
    task = task_for(config)
    for split, context in (("train", "training"), ("eval", "evaluation")):
        questions = task.questions(config, split)
        digest = hashlib.sha256(
            "\n".join(f"{q.qid}\t{q.question}\t{q.answers}" for q in questions).encode()
        ).hexdigest()
        tracker.log_dataset(
            f"{config.task.name}-{split}", config.data_spec(split), digest, context, rows=len(questions)
        )


def log_iteration(tracker: Tracker, store: Store, i: int, metrics: dict[str, float], stages: dict[str, str]) -> None:
    """Iteration ``i`` at step ``i + 1``: its metrics, its stages' URIs (lineage), sample
    agent calls (episodes table) and its trajectories (a dataset input)."""
    tracker.log_metrics(metrics, step=i + 1)
    tracker.log_lineage(i, {name: store.uri(path) for name, path in stages.items()})
    rollout = stages["rollout"]
    table = store.open(rollout).read_table("trajectories.parquet").slice(0, SAMPLE_CALLS)
    columns = ("traj_uid", "env_step", "agent", "response_text", "is_valid", "reward")
    tracker.log_episodes(i, {name: table[name].to_pylist() for name in columns})
    tracker.log_dataset(f"trajectories-iter-{i:06d}", store.uri(rollout), store.fingerprint(rollout), "rollout")


def iteration_stages(config: DrmasConfig, store: Store, run_id: str, i: int, evaluated: bool) -> dict[str, str]:
    """Stage name -> store path of iteration ``i``'s outputs, named as the runner names them
    (an update's newest version)."""
    experiment = config.experiment.name
    stages = {name: stage_path(experiment, run_id, i, name) for name in ("rollout", "advantage")}
    for group in config.worker_groups():
        policy, optim = current_update(store, experiment, run_id, i, group.name)
        stages[f"policy/{group.name}"], stages[f"optim/{group.name}"] = policy, optim
    if evaluated:
        stages["evaluate"] = EvaluateContract(iteration_path(experiment, run_id, i), {}).output(config)
    stages["checkpoint"] = stage_path(experiment, run_id, i, "checkpoint")
    return stages


def stored_iteration(
    config: DrmasConfig, store: Store, run_id: str, i: int
) -> tuple[dict[str, float], dict[str, str]] | None:
    """(metrics, stages) of iteration ``i`` as the store holds them (its checkpoint's
    metrics with its evaluation's), or None when it has no checkpoint."""
    metrics = iteration_metrics(config, store, run_id, i)
    if metrics is None:
        return None
    evaluated = store.exists(iteration_stages(config, store, run_id, i, True)["evaluate"])
    return metrics, iteration_stages(config, store, run_id, i, evaluated)


def finish_run(
    config: DrmasConfig,
    store: Store,
    run_id: str,
    tracker: Tracker,
    summary: RunSummary,
    policies: dict[str, str],
    history: History | None = None,
) -> None:
    """The report (into the store and MLflow) of ``history`` (default: the run's, read from
    the store), each worker group's final policy registered (``policies``: wg -> store
    path), and the MLflow run ended; fills in ``summary.report``."""
    if history is None:
        history = run_history(config, store, run_id)
    path = report_path(config.experiment.name, run_id)
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch) / "report"
        files = write_report(config, history, folder, summary_table(summary, config.eval.k))
        (folder / TRACKING_FILE).write_text(
            json.dumps(
                {
                    "uri": tracker.url,
                    "link": summary.tracking,
                    "experiment_id": tracker.experiment_id,
                    "run": tracker.mlflow_run_id,
                }
            )
        )
        with store.writer(path, overwrite=True, meta={"stage": "report"}) as out:
            out.put_dir(folder, "")
        tracker.log_files(files, "report")
    summary.report = store.uri(path)
    tracker.register_policies({wg: store.uri(artifact) for wg, artifact in policies.items()}, summary.last_iteration)
    tracker.finish()  # it reports what MLflow lacks, if anything


def summary_table(summary: RunSummary, k: int) -> str:
    """Before and after, side by side: eval success and each agent's output validity
    (empty when the run has no evaluation)."""
    if not summary.before and not any(key.startswith("eval/") for key in summary.metrics):
        return ""
    rows = [(f"eval avg@{k}", f"eval/avg_at_{k}"), (f"eval pass@{k}", f"eval/pass_at_{k}")]
    agents = sorted(
        {key.split("/")[2] for key in summary.metrics if key.startswith("eval/agent/") and key.endswith("/valid_rate")}
    )
    rows += [(f"{agent} valid outputs", f"eval/agent/{agent}/valid_rate") for agent in agents]
    lines = [f"{'':24} {'before':>8} {'after':>8}"]
    for label, key in rows:
        first, last = summary.before.get(key), summary.metrics.get(key)
        lines.append(
            f"{label:24} {'' if first is None else f'{first:8.3f}':>8} {'' if last is None else f'{last:8.3f}':>8}"
        )
    return "\n".join(lines)


def eval_line(metrics: dict[str, float], k: int) -> str:
    return (
        f"eval avg@{k} {metrics.get(f'eval/avg_at_{k}', float('nan')):.3f} "
        f"pass@{k} {metrics.get(f'eval/pass_at_{k}', float('nan')):.3f}"
    )


def summary_line(iteration: int, metrics: dict[str, float], k: int) -> str:
    """One iteration in one line: rewards (mean, per agent), times, evaluation when due."""
    agents = sorted({key.split("/")[1] for key in metrics if key.startswith("agent/") and key.endswith("/reward_mean")})
    per_agent = " ".join(f"{a}={metrics[f'agent/{a}/reward_mean']:.3f}" for a in agents)
    line = (
        f"iter {iteration}: reward {metrics.get('reward/mean', float('nan')):.3f} [{per_agent}] "
        f"rollout {metrics.get('time/rollout', 0):.1f}s iteration {metrics.get('time/iteration', 0):.1f}s"
        + (f" | {eval_line(metrics, k)}" if f"eval/avg_at_{k}" in metrics else "")
    )
    final = {key.removeprefix(FINAL_PREFIX): value for key, value in metrics.items() if key.startswith(FINAL_PREFIX)}
    final_k = next((int(m.group(1)) for key in final if (m := re.fullmatch(r"eval/avg_at_(\d+)", key))), None)
    return line + (f" | final {eval_line(final, final_k)}" if final_k is not None else "")


# --- the Kubeflow pipeline's tracking steps -------------------------------------------------


def _open(config: DrmasConfig, store: Store, run_id: str, tags: dict[str, str] | None = None) -> Tracker:
    from drmas.infra.tracking import Tracker  # noqa: PLC0415

    return Tracker(config, run_id, store.root, tags=tags)


def _not_logged(what: str, error: Exception) -> str:
    """Say that ``what`` did not reach MLflow, and why; the step goes on (tracking never
    fails the pipeline: the stages' results are in the store, MLflow is a view of them)."""
    from drmas.infra.tracking import error_reason  # noqa: PLC0415

    reason = f"{what} not logged to MLflow ({error_reason(error)}); the pipeline goes on"
    log.warning("tracking: %s", reason)
    return reason


def track_start(config: DrmasConfig, store: Store, run_id: str, first_iteration: int, tags: dict[str, str]) -> str:
    """Open (or find) the run's MLflow run, tag it with ``tags`` (the KFP run id, the
    image) and log the question sets when the run starts at iteration 0; returns the
    Markdown page that links to it."""
    try:
        tracker = _open(config, store, run_id, tags)
        if first_iteration == 0:
            log_question_sets(config, tracker)
        tracker.close()
    except Exception as error:  # tracking never fails the pipeline: see _not_logged
        return _page(config, store, run_id, None, problem=_not_logged("the start of the run", error))
    log.info("tracking: %s", tracker.where(config.tracking.ui_url))
    return _page(config, store, run_id, tracker)


def track_iteration(config: DrmasConfig, store: Store, run_id: str, iteration: int) -> None:
    """Log a checkpointed iteration from the store (``-1``: the evaluation before
    training, at step 0)."""
    try:
        tracker = _open(config, store, run_id)
        if iteration < 0:
            before = evaluation_path(init_home(config.experiment.name, run_id))
            tracker.log_metrics(store.open(before).read_json("metrics.json"), step=0)
        else:
            stored = stored_iteration(config, store, run_id, iteration)
            if stored is None:
                raise ValueError(f"iteration {iteration} of run {run_id} has no checkpoint in the store")
            log_iteration(tracker, store, iteration, *stored)
        tracker.close()
    except Exception as error:  # tracking never fails the pipeline: see _not_logged
        _not_logged(f"iteration {iteration}" if iteration >= 0 else "the evaluation before training", error)


def track_end(config: DrmasConfig, store: Store, run_id: str, last_iteration: int) -> str:
    """After the pipeline's last iteration: the report and, when that iteration is the
    run's last, the registered policies and the MLflow run ended; returns the Markdown page
    with the link and the headline figures."""
    history = run_history(config, store, run_id)
    steps = dict(history)
    summary = RunSummary(
        run_id,
        len(steps) - (0 in steps),
        last_iteration,
        steps.get(last_iteration + 1, {}),
        steps.get(0, {}),
        checkpoint=store.uri(stage_path(config.experiment.name, run_id, last_iteration, "checkpoint")),
    )
    try:
        tracker = _open(config, store, run_id)
        summary.tracking = tracker.where(config.tracking.ui_url)
        if last_iteration == config.total_iterations - 1:
            groups = [group.name for group in config.worker_groups()]
            experiment = config.experiment.name
            policies = {wg: current_update(store, experiment, run_id, last_iteration, wg)[0] for wg in groups}
            finish_run(config, store, run_id, tracker, summary, policies, history)
        else:
            tracker.close()
    except Exception as error:  # tracking never fails the pipeline: see _not_logged
        return _page(config, store, run_id, None, history, summary, problem=_not_logged("the end of the run", error))
    return _page(config, store, run_id, tracker, history, summary)


def _page(
    config: DrmasConfig,
    store: Store,
    run_id: str,
    tracker: Tracker | None,
    history: list[tuple[int, dict[str, float]]] = (),  # type: ignore[assignment]
    summary: RunSummary | None = None,
    problem: str = "",
) -> str:
    """The Markdown a Kubeflow step shows in its Visualizations tab: where the MLflow run
    and the store are and, at the end, the headline figures of every iteration."""
    lines = [f"# drmas run `{run_id}`", ""]
    if tracker is not None:
        ui = config.tracking.ui_url
        start = f" (start the UI first: `{tracker.to_start(ui)}`)" if tracker.to_start(ui) else ""
        lines.append(f"- MLflow: [{tracker.experiment_name} / {run_id}]({tracker.link(ui)}){start}")
    else:
        lines.append(f"- MLflow: {problem}")
    lines.append(f"- store: `{store.uri(run_path(config.experiment.name, run_id))}`")
    if summary is None:
        return "\n".join(lines) + "\n"
    if summary.report:
        lines.append(f"- report: `{summary.report}/report.md`")
    k = config.eval.k
    columns = [
        ("reward", "reward/mean"),
        (f"eval avg@{k}", f"eval/avg_at_{k}"),
        (f"eval pass@{k}", f"eval/pass_at_{k}"),
    ]
    lines += [
        "",
        "| iteration | " + " | ".join(label for label, _ in columns) + " |",
        "|---" * (1 + len(columns)) + "|",
    ]
    for step, metrics in history:
        cells = [f"{metrics[key]:.3f}" if key in metrics else "" for _, key in columns]
        lines.append(f"| {'before' if step == 0 else step - 1} | " + " | ".join(cells) + " |")
    if table := summary_table(summary, k):
        lines += ["", "```", table, "```"]
    return "\n".join(lines) + "\n"
