"""The evaluate stage: the team on the eval split, k episodes per question.

    evaluate(config, store, path, policies, pool) -> StageResult

Reports avg@k (mean success over the k episodes of a question, averaged over questions)
and pass@k (any success among the k), overall and per data source, with per-agent call
counts and validity rates; writes one row per episode to ``eval.parquet``. Metric names
use ``_at_`` (``eval/avg_at_4``) because MLflow does not accept '@' in a metric name; a
data source comes from the data (``Counting & Probability``, ``openai/gsm8k``), so it is
written with MLflow's characters only (``source_label``): one bad name would lose the
whole step's metrics.
"""

from __future__ import annotations

import re
import time

import numpy as np
import pyarrow as pa

from drmas.config import DrmasConfig
from drmas.infra.layout import PolicyRef, StageResult
from drmas.infra.store import Store
from drmas.stages.checkpoint import check_policy
from drmas.stages.rollout import GeneratePool, agent_call_metrics, build_team, play, task_questions, task_tools
from drmas.team.episodes import Episode

__all__ = ["evaluate", "source_label", "success_at_k"]

_NOT_IN_METRIC_NAMES = re.compile(r"[^\w.\- ]")
"""What MLflow refuses in a metric name (it takes letters, digits, ``_ . - space /`` and,
except on Windows, ``:``), and ``/``: a source is one level of the name."""


def source_label(source: str) -> str:
    """A data source as one level of a metric name: every other character as ``_``
    (``Counting & Probability`` -> ``Counting _ Probability``); dots alone (a path step
    to MLflow) too. Two sources with one label are reported together."""
    label = _NOT_IN_METRIC_NAMES.sub("_", source.strip()) or "_"
    return label if label.strip(".") else label.replace(".", "_")


def success_at_k(episodes: list[Episode], k: int) -> dict[str, float]:
    """avg@k and pass@k over questions (``uid``), overall and per data source
    (``eval/{source_label}/avg_at_{k}``)."""
    by_question: dict[str, list[Episode]] = {}
    for episode in episodes:
        by_question.setdefault(episode.uid, []).append(episode)
    metrics: dict[str, float] = {}
    sources = sorted({source_label(group[0].question.data_source) for group in by_question.values()})
    for source in [None, *sources]:
        groups = [
            g for g in by_question.values() if source is None or source_label(g[0].question.data_source) == source
        ]
        prefix = "eval" if source is None else f"eval/{source}"
        metrics[f"{prefix}/avg_at_{k}"] = float(np.mean([np.mean([e.success for e in g]) for g in groups]))
        metrics[f"{prefix}/pass_at_{k}"] = float(np.mean([any(e.success for e in g) for g in groups]))
        metrics[f"{prefix}/questions"] = float(len(groups))
    return metrics


def evaluate(
    config: DrmasConfig,
    store: Store,
    path: str,
    policies: dict[str, PolicyRef],
    pool: GeneratePool,
    overwrite: bool = False,
    cache_key: str = "",
) -> StageResult:
    """Evaluate ``policies`` on the eval split; write ``{path}/eval.parquet`` and metrics.

    Each policy is checked first (``check_policy``): a checkpoint of another model or with
    pickled weights is refused with its path before any worker group loads it.
    """
    started = time.perf_counter()
    k = config.eval.k
    questions = task_questions(config, "eval")[: config.eval.max_questions]
    for group in config.worker_groups():
        check_policy(group, store, policies[group.name])
    pool.load(policies)
    orchestra, team = build_team(config, task_tools(config, store), pool, seed=config.experiment.seed + 7919)
    team.sampling = {agent.name: config.eval.sampling for agent in config.agents}
    episodes = play(orchestra, team, questions, k, prefix="eval", title=f"evaluate {len(questions)} questions x {k}")
    metrics = success_at_k(episodes, k) | agent_call_metrics(episodes, list(team.agents), prefix="eval/agent")
    metrics["time/evaluate"] = time.perf_counter() - started
    table = pa.table(
        {
            "uid": [e.uid for e in episodes],
            "traj_uid": [e.traj_uid for e in episodes],
            "data_source": [e.question.data_source for e in episodes],
            "question": [e.question.question for e in episodes],
            "answers": [list(e.question.answers) for e in episodes],
            "final_answer": [e.final_answer or "" for e in episodes],
            "reward": pa.array([e.reward for e in episodes], pa.float32()),
            "success": [e.success for e in episodes],
            "calls": pa.array([len(e.calls) for e in episodes], pa.int32()),
        }
    )
    with store.writer(path, overwrite=overwrite, meta={"stage": "evaluate", "k": k, "cache_key": cache_key}) as out:
        out.write_table("eval.parquet", table)
        out.write_json("metrics.json", metrics)
    return StageResult(path, metrics)
