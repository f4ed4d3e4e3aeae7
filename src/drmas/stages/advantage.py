"""The advantage stage: trajectories.parquet -> batch.parquet with score, group and advantage.

    advantage(config, store, run_id, iteration) -> StageResult

Pure table work around ``drmas.algos``: score = reward - penalty * (1 - is_valid) per call,
the normalisation group (``uid`` for GRPO, ``uid/agent`` for Dr. MAS), the advantage, and
per-agent statistics as metrics: the Lemma 4.2 multiplier and its two terms per prompt
group (what the lemma says the global baseline does to each agent's gradient second
moment) and the measured ratio of the agent's advantage second moment under the global
baseline over Dr. MAS (both modes' advantages are computed on every batch for it).
"""

from __future__ import annotations

import time

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from drmas.algos import advantage_second_moment_ratio, agent_reward_stats, compute_advantages, row_scores
from drmas.config import DrmasConfig
from drmas.infra.layout import StageResult, stage_path
from drmas.infra.schema import BATCH_SCHEMA, TRAJECTORY_SCHEMA
from drmas.infra.store import Store

__all__ = ["StageResult", "add_advantages", "advantage"]

KEY_COLUMNS = ["uid", "traj_uid", "agent"]


def add_advantages(trajectories: pa.Table, config: DrmasConfig) -> tuple[pa.Table, dict[str, float]]:
    """The batch table (trajectories + score, group_id, advantage) and its metrics."""
    algorithm = config.algorithm
    score = row_scores(
        trajectories["reward"].to_numpy(), trajectories["is_valid"].to_numpy(), algorithm.invalid_penalty
    )  # [N]
    keys = [trajectories[column] for column in KEY_COLUMNS]
    # Both modes, always: the batch trains with one, the diagnostics compare the two.
    by_mode = {
        mode: compute_advantages(score, *keys, mode=mode, eps=algorithm.eps, scale_by_std=algorithm.scale_by_std)
        for mode in ("grpo", "drmas")
    }
    advantages = by_mode[algorithm.advantage]
    uid = pc.cast(trajectories["uid"], pa.string())
    group = (
        uid
        if algorithm.advantage == "grpo"
        else pc.binary_join_element_wise(uid, pc.cast(trajectories["agent"], pa.string()), "/")
    )
    batch = trajectories.append_column("score", pa.array(score, pa.float32()))
    batch = batch.append_column("group_id", group).append_column("advantage", pa.array(advantages))
    return batch, batch_metrics(score, by_mode, algorithm.advantage, trajectories)


def batch_metrics(
    score: np.ndarray, by_mode: dict[str, np.ndarray], mode: str, trajectories: pa.Table
) -> dict[str, float]:
    """Team and per-agent statistics, named as in docs/architecture.md §8: per agent, its
    rewards, its advantages under the training ``mode``, the Lemma 4.2 terms per prompt
    group and the measured second-moment ratio of the global baseline over Dr. MAS."""
    agents = pc.cast(trajectories["agent"], pa.string()).to_numpy(zero_copy_only=False)
    reward = trajectories["reward"].to_numpy()
    first_row = np.unique(trajectories["traj_uid"].to_numpy(zero_copy_only=False), return_index=True)[1]
    metrics = {
        "reward/mean": float(reward[first_row].mean()) if len(first_row) else 0.0,
        "batch/rows": float(len(score)),
        "batch/valid_rate": float(trajectories["is_valid"].to_numpy().mean()) if len(score) else 0.0,
    }
    advantages = by_mode[mode]
    lemma = agent_reward_stats(score, agents, uid=trajectories["uid"], traj_uid=trajectories["traj_uid"])
    measured = advantage_second_moment_ratio(by_mode["grpo"], by_mode["drmas"], agents)
    for name, stats in lemma.items():
        mine = agents == name
        metrics |= {
            f"agent/{name}/calls": float(stats.rows),
            f"agent/{name}/reward_mean": float(reward[mine].mean()),
            f"agent/{name}/score_mean": float(score[mine].mean()),
            f"agent/{name}/score_std": float(score[mine].std()),
            f"agent/{name}/adv_mean": float(advantages[mine].mean()),
            f"agent/{name}/adv_std": float(advantages[mine].std()),
            f"agent/{name}/adv_sq_ratio": measured[name],
            f"agent/{name}/lemma_multiplier": stats.inflation_mean,
            f"agent/{name}/lemma_multiplier_p95": stats.inflation_p95,
            f"agent/{name}/lemma_multiplier_max": stats.inflation_max,
            f"agent/{name}/lemma_mean_gap": stats.mean_gap_mean,
            f"agent/{name}/lemma_mean_gap_abs": stats.mean_gap_abs_mean,
            f"agent/{name}/lemma_mean_gap_abs_max": stats.mean_gap_abs_max,
            f"agent/{name}/lemma_var_ratio": stats.var_ratio_mean,
            f"agent/{name}/lemma_var_ratio_min": stats.var_ratio_min,
            f"agent/{name}/lemma_var_ratio_max": stats.var_ratio_max,
            f"agent/{name}/lemma_groups": float(stats.groups),
            f"agent/{name}/lemma_flat_groups": float(stats.flat_groups),
        }
        metrics |= {f"agent/{name}/adv_diag/{key}": value for key, value in stats.reference.items()}
    return metrics


def advantage(
    config: DrmasConfig, store: Store, run_id: str, iteration: int, overwrite: bool = False, cache_key: str = ""
) -> StageResult:
    """Read the iteration's trajectories, write its batch (manifest last)."""
    started = time.perf_counter()
    experiment = config.experiment.name
    source = store.open(stage_path(experiment, run_id, iteration, "rollout"))
    trajectories = source.read_table("trajectories.parquet", TRAJECTORY_SCHEMA, dictionary_columns=KEY_COLUMNS)
    batch, metrics = add_advantages(trajectories, config)
    metrics["time/advantage"] = time.perf_counter() - started
    path = stage_path(experiment, run_id, iteration, "advantage")
    meta = {
        "stage": "advantage",
        "iteration": iteration,
        "input": source.uri,
        "mode": config.algorithm.advantage,
        "cache_key": cache_key,
    }
    with store.writer(path, overwrite=overwrite, meta=meta) as out:
        out.write_table("batch.parquet", batch, BATCH_SCHEMA)
        out.write_json("metrics.json", metrics)
    return StageResult(path, metrics)
