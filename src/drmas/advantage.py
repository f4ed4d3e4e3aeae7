"""The advantage stage: trajectories.parquet -> batch.parquet with score, group and advantage.

    advantage(config, store, run_id, iteration) -> StageResult

Pure table work around ``drmas.algos``: score = reward - penalty * (1 - is_valid) per call,
the normalisation group (``uid`` for GRPO, ``uid/agent`` for Dr. MAS), the advantage, and
per-agent statistics as metrics, including the Lemma 4.2 multiplier and its two terms,
which show how much the global baseline would scale each agent's gradient.
"""

from __future__ import annotations

import time

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from drmas.algos import agent_reward_stats, compute_advantages, row_scores
from drmas.config import DrmasConfig
from drmas.layout import StageResult, stage_path
from drmas.schema import BATCH_SCHEMA, TRAJECTORY_SCHEMA
from drmas.store import Store

__all__ = ["StageResult", "add_advantages", "advantage"]

KEY_COLUMNS = ["uid", "traj_uid", "agent"]


def add_advantages(trajectories: pa.Table, config: DrmasConfig) -> tuple[pa.Table, dict[str, float]]:
    """The batch table (trajectories + score, group_id, advantage) and its metrics."""
    algorithm = config.algorithm
    score = row_scores(
        trajectories["reward"].to_numpy(), trajectories["is_valid"].to_numpy(), algorithm.invalid_penalty
    )  # [N]
    keys = [trajectories[column] for column in KEY_COLUMNS]
    advantages = compute_advantages(score, *keys, mode=algorithm.advantage, eps=algorithm.eps, scale_by_std=algorithm.scale_by_std)
    uid = pc.cast(trajectories["uid"], pa.string())
    group = uid if algorithm.advantage == "grpo" else pc.binary_join_element_wise(uid, pc.cast(trajectories["agent"], pa.string()), "/")
    batch = trajectories.append_column("score", pa.array(score, pa.float32()))
    batch = batch.append_column("group_id", group).append_column("advantage", pa.array(advantages))
    return batch, batch_metrics(score, advantages, trajectories)


def batch_metrics(score: np.ndarray, advantages: np.ndarray, trajectories: pa.Table) -> dict[str, float]:
    """Team and per-agent statistics, named as in DESIGN.md section 7."""
    agents = pc.cast(trajectories["agent"], pa.string()).to_numpy(zero_copy_only=False)
    reward = trajectories["reward"].to_numpy()
    first_row = np.unique(trajectories["traj_uid"].to_numpy(zero_copy_only=False), return_index=True)[1]
    metrics = {
        "reward/mean": float(reward[first_row].mean()) if len(first_row) else 0.0,
        "batch/rows": float(len(score)),
        "batch/valid_rate": float(trajectories["is_valid"].to_numpy().mean()) if len(score) else 0.0,
    }
    for name, stats in agent_reward_stats(score, agents).items():
        mine = agents == name
        metrics |= {
            f"agent/{name}/calls": float(stats.rows),
            f"agent/{name}/reward_mean": float(reward[mine].mean()),
            f"agent/{name}/score_mean": stats.mean,
            f"agent/{name}/score_std": stats.std,
            f"agent/{name}/adv_mean": float(advantages[mine].mean()),
            f"agent/{name}/adv_std": float(advantages[mine].std()),
            f"agent/{name}/lemma_multiplier": stats.multiplier,
            f"agent/{name}/lemma_variance_ratio": stats.variance_ratio,
            f"agent/{name}/lemma_mean_mismatch": stats.mean_mismatch,
        }
    return metrics


def advantage(config: DrmasConfig, store: Store, run_id: str, iteration: int, overwrite: bool = False, cache_key: str = "") -> StageResult:
    """Read the iteration's trajectories, write its batch (manifest last)."""
    started = time.perf_counter()
    experiment = config.experiment.name
    source = store.open(stage_path(experiment, run_id, iteration, "rollout"))
    trajectories = source.read_table("trajectories.parquet", TRAJECTORY_SCHEMA, dictionary_columns=KEY_COLUMNS)
    batch, metrics = add_advantages(trajectories, config)
    metrics["time/advantage"] = time.perf_counter() - started
    path = stage_path(experiment, run_id, iteration, "advantage")
    meta = {"stage": "advantage", "iteration": iteration, "input": source.uri, "mode": config.algorithm.advantage, "cache_key": cache_key}
    with store.writer(path, overwrite=overwrite, meta=meta) as out:
        out.write_table("batch.parquet", batch, BATCH_SCHEMA)
        out.write_json("metrics.json", metrics)
    return StageResult(path, metrics)
