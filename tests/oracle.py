"""Plain-loop oracles for drmas.algos: slow, obvious, written straight from docs/architecture.md §1.

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
    for value, group in zip(values, groups, strict=True):
        mean, std = stats[group]
        result.append((value - mean) / (std + eps) if scale_by_std else value - mean)
    return result


def loop_lemma_terms(score, uid, traj_uid, agent) -> dict:
    """Per agent, the lists of (mean_gap, var_ratio, inflation) over its (uid, agent)
    groups with GRPO spread, read straight from the reference's definitions: (mu, sigma)
    over each uid's trajectory means, (mu_k, sigma_k) over agent k's rows in the uid."""
    traj_rows: dict = defaultdict(list)
    for i in range(len(score)):
        traj_rows[traj_uid[i]].append(i)
    uid_values: dict = defaultdict(list)
    for rows in traj_rows.values():
        uid_values[uid[rows[0]]].append(sum(score[i] for i in rows) / len(rows))
    agent_values: dict = defaultdict(list)
    for i in range(len(score)):
        agent_values[(uid[i], agent[i])].append(score[i])
    terms: dict = defaultdict(list)
    for (u, k), values in agent_values.items():
        mu, sigma = _mean_std(uid_values[u])
        mu_k, sigma_k = _mean_std(values)
        if sigma**2 <= 1e-12 * max(1.0, mu**2):
            continue
        gap = mu_k - mu
        terms[k].append((gap, sigma_k**2 / sigma**2, (sigma_k**2 + gap**2) / sigma**2))
    return terms
