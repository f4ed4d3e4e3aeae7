"""Plain-loop oracles for drmas.algos: slow, obvious, written straight from DESIGN.md §1.

They exist so that the vectorised code is tested against a second, independent reading of
the reference semantics (tests) and timed against it (bench/advantage.py).
"""

from __future__ import annotations

import math
from collections import defaultdict


def _mean_std(values: list[float]) -> tuple[float, float]:
    """Reference conventions: a singleton group has mean 0 and std 1; std is unbiased."""
    if len(values) == 1:
        return 0.0, 1.0
    mean = sum(values) / len(values)
    variance = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return mean, math.sqrt(variance)


def loop_advantages(score, uid, traj_uid, agent, mode, eps=1e-6, scale_by_std=True) -> list[float]:
    """One Python iteration per row; dictionaries for the groups."""
    rows = range(len(score))
    if mode == "grpo":
        traj_rows: dict = defaultdict(list)
        for i in rows:
            traj_rows[traj_uid[i]].append(i)
        traj_value = {t: sum(score[i] for i in idx) / len(idx) for t, idx in traj_rows.items()}
        group_values: dict = defaultdict(list)
        for t, idx in traj_rows.items():
            group_values[uid[idx[0]]].append(traj_value[t])
        values = [traj_value[traj_uid[i]] for i in rows]
        groups = [uid[i] for i in rows]
    else:
        group_values = defaultdict(list)
        for i in rows:
            group_values[(uid[i], agent[i])].append(score[i])
        values = [score[i] for i in rows]
        groups = [(uid[i], agent[i]) for i in rows]
    stats = {g: _mean_std(v) for g, v in group_values.items()}
    result = []
    for value, group in zip(values, groups):
        mean, std = stats[group]
        result.append((value - mean) / (std + eps) if scale_by_std else value - mean)
    return result
