"""The math of drmas: advantages, reward diagnostics and the clipped policy loss.

Pure functions, arrays in and arrays out; no I/O, no distributed state. Every stage and
every trainer calls these, so that the algorithm lives in one place.

Shape notation, used on every array line below:
    N  rows: one row per LLM call by any agent (a trajectory has one or more rows)
    T  trajectories (episodes, key ``traj_uid``); a GRPO group has G of them per prompt
    U  prompt groups (key ``uid``)
    K  agents
    S  groups actually normalised over (U for ``grpo``, U*K for ``drmas``)
    B  sequences in a micro-batch, L response tokens per sequence

How Dr. MAS differs from multi-agent GRPO (arXiv 2602.08847):
 1. Every agent call is one training row. The episode's task reward R is copied to each of
    its rows; a row whose output was malformed loses a penalty: ``score = R - c*(1-valid)``.
 2. GRPO (the paper's global baseline, Eq. 3): the group is the prompt (``uid``). Each
    trajectory is ONE sample, the mean of its rows' scores; all rows of a trajectory get
    that trajectory's normalised value, whichever agent made them.
 3. Dr. MAS (Eq. 5): the group is (``uid``, ``agent``) and every row is a sample, so the
    statistics are action-weighted and each agent is centred and scaled by its own mean
    mu_k and std sigma_k. Lemma 4.2 shows why: under the global baseline (mu, sigma) the
    gradient second moment of agent k is multiplied by (sigma_k^2 + (mu_k - mu)^2)/sigma^2,
    which explodes when an agent's reward distribution differs from the team's.
 4. Conventions kept from the reference code: unbiased std (N-1), ``eps`` added to the
    std (not the variance), a singleton group has mean 0 and std 1 (so A = the raw score),
    a constant group has A = 0, and ``scale_by_std=False`` only centres (Dr. GRPO style).
 5. The update is the PPO clipped objective with separate low/high clip ranges and a dual
    clip for negative advantages, the row's advantage on every response token.

Groups are uneven by construction (agents act a variable number of times), so everything
below is a segment reduction over integer group codes: keys are factorised once
(``drmas.grouping``), then ``np.bincount`` does the sums. There is no loop over rows or
groups.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from drmas.grouping import code_names, combine_codes, factorize, key_at

if TYPE_CHECKING:
    import torch

AdvantageMode = Literal["grpo", "drmas"]
LossAggregation = Literal["token-mean", "token-mean-per-micro-batch", "seq-mean-token-mean", "seq-mean-token-sum"]

__all__ = [
    "AdvantageMode",
    "AgentRewardStats",
    "LossAggregation",
    "agent_reward_stats",
    "advantage_second_moment_ratio",
    "aggregate_loss",
    "compute_advantages",
    "low_var_kl",
    "policy_loss",
    "row_scores",
]


# --------------------------------------------------------------------------------------
# Advantages
# --------------------------------------------------------------------------------------


def row_scores(reward: np.ndarray, is_valid: np.ndarray, penalty_coef: float) -> np.ndarray:
    """score = R - coef * (1 - is_valid), per row: only the malformed call is penalised."""
    reward = np.asarray(reward, dtype=np.float64)  # [N]
    invalid = 1.0 - np.asarray(is_valid, dtype=np.float64)  # [N]
    return reward - penalty_coef * invalid


def compute_advantages(
    score: np.ndarray,
    uid: Any,
    traj_uid: Any,
    agent: Any,
    mode: AdvantageMode,
    eps: float = 1e-6,
    scale_by_std: bool = True,
) -> np.ndarray:
    """Per-row advantages, float32 [N], for the global GRPO baseline or Dr. MAS.

    ``grpo``: the sample of a trajectory is the mean of its rows' scores, normalised over
    the trajectories of its ``uid``; every row gets its trajectory's value.
    ``drmas``: every row is normalised over the rows of the same (``uid``, ``agent``).
    """
    score = np.asarray(score, dtype=np.float64)  # [N]
    n_rows = len(score)
    _check_lengths(n_rows, uid=uid, traj_uid=traj_uid, agent=agent)
    if n_rows == 0:
        return np.zeros(0, dtype=np.float32)
    if not np.all(np.isfinite(score)):
        bad = int(np.flatnonzero(~np.isfinite(score))[0])
        raise ValueError(f"score is not finite at row {bad}: {score[bad]}")
    uid_code, n_uid = factorize(uid)  # [N]
    if mode == "grpo":
        traj_code, traj_score, traj_uid_code = _trajectory_scores(score, uid_code, traj_uid)
        traj_adv = _normalise_in_groups(traj_score, traj_uid_code, n_uid, eps, scale_by_std)
        advantages = traj_adv[traj_code]  # [N]
    elif mode == "drmas":
        agent_code, n_agent = factorize(agent)  # [N]
        group, n_group = combine_codes(uid_code, agent_code, n_agent)  # [N], S
        advantages = _normalise_in_groups(score, group, n_group, eps, scale_by_std)
    else:
        raise ValueError(f"unknown advantage mode {mode!r}; expected 'grpo' or 'drmas'")
    return advantages.astype(np.float32)


def _check_lengths(n_rows: int, **columns: Any) -> None:
    for name, column in columns.items():
        if len(column) != n_rows:
            raise ValueError(f"{name} has {len(column)} rows but score has {n_rows}")


def _group_of_segment(segment: np.ndarray, group: np.ndarray, n_segments: int, segment_keys: Any) -> np.ndarray:
    """The group of each segment (e.g. the uid of each trajectory), checked to be unique."""
    group_of = np.empty(n_segments, dtype=np.int64)  # [T]
    group_of[segment] = group
    conflict = group_of[segment] != group  # [N]
    if conflict.any():
        row = int(np.flatnonzero(conflict)[0])
        key = key_at(segment_keys, row)
        raise ValueError(f"traj_uid {key!r} (row {row}) belongs to more than one uid")
    return group_of


def _group_moments(values: np.ndarray, group: np.ndarray, n_groups: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(count, mean, unbiased std) per group [S], with the reference's conventions: a
    singleton group has mean 0 and std 1; an empty group has count 0 (ignore its moments).

    Two passes (mean, then squared deviations) rather than sum of squares, which loses
    precision when rewards are large and nearly constant.
    """
    count = np.bincount(group, minlength=n_groups).astype(np.float64)  # [S]
    mean = np.bincount(group, weights=values, minlength=n_groups) / np.maximum(count, 1)  # [S]
    deviation = values - mean[group]  # [N]
    sq_sum = np.bincount(group, weights=deviation * deviation, minlength=n_groups)  # [S]
    std = np.sqrt(sq_sum / np.maximum(count - 1, 1))  # [S]
    singleton = count == 1
    mean[singleton] = 0.0
    std[singleton] = 1.0
    return count, mean, std


def _normalise_in_groups(
    values: np.ndarray, group: np.ndarray, n_groups: int, eps: float, scale_by_std: bool
) -> np.ndarray:
    """(v - mean_g) / (std_g + eps) with the moments of ``_group_moments``."""
    _, mean, std = _group_moments(values, group, n_groups)
    centred = values - mean[group]  # [N]
    if not scale_by_std:
        return centred
    denominator = std[group] + eps  # [N]; 0 only for a constant group with eps = 0
    return np.divide(centred, denominator, out=np.zeros_like(centred), where=denominator > 0)


def _trajectory_scores(
    score: np.ndarray, uid_code: np.ndarray, traj_uid: Any
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """GRPO's samples: (trajectory code of each row [N], each trajectory's mean score [T],
    each trajectory's uid code [T]); a trajectory spread over two uids is refused."""
    traj_code, n_traj = factorize(traj_uid)  # [N]
    traj_uid_code = _group_of_segment(traj_code, uid_code, n_traj, traj_uid)  # [T]
    traj_count = np.bincount(traj_code, minlength=n_traj)  # [T]
    traj_score = np.bincount(traj_code, weights=score, minlength=n_traj) / traj_count  # [T]
    return traj_code, traj_score, traj_uid_code


# --------------------------------------------------------------------------------------
# Reward diagnostics (Lemma 4.2)
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AgentRewardStats:
    """Agent k's Lemma 4.2 terms, per prompt group, summarised over the groups.

    For every (``uid``, agent) group where agent k acted, against the (mu, sigma) that the
    GRPO baseline divides by for that ``uid`` (trajectory means, unbiased std):
    ``mean_gap = mu_k - mu``, ``var_ratio = sigma_k^2 / sigma^2`` and the multiplier
    ``inflation = (sigma_k^2 + mean_gap^2) / sigma^2``, by which the global baseline scales
    agent k's gradient second moment. mu_k, sigma_k are over agent k's calls in the group
    (every call a sample, unbiased std, a single call has mean 0 and std 1), exactly as the
    Dr. MAS advantage uses them. The definitions are the reference code's
    (``summarize_group_diagnostics``, logged there as ``adv_diag/<agent>/...``) with one
    difference: a group whose GRPO sigma is 0 (every trajectory of the prompt scored the
    same) has no multiplier, since a ratio to no spread measures nothing. It is counted in
    ``flat_groups`` and left out of the summaries, which are NaN when no group is left.

    The reference keeps such groups, with ``sigma^2 + 1e-12`` in the denominators: most
    give 0 (every call of the agent scored alike, so sigma_k = 0 and no gap), and about
    10^12 where the agent made one call in the group (sigma_k = 1 by convention) or format
    penalties open a gap between the agent's calls and the trajectory means. A flat group is
    not one both baselines leave at 0: with penalties Dr. MAS still gives the agent's calls
    advantages (two trajectories scoring 1, one with an invalid Solver call and one with an
    invalid Verifier call, give each agent +-0.71). ``reference`` holds the summaries as the
    reference computes them, over every group, to read a run against the authors' plots.
    """

    agent: str
    rows: int
    groups: int
    flat_groups: int
    inflation_mean: float
    inflation_p95: float
    inflation_max: float
    mean_gap_mean: float
    mean_gap_abs_mean: float
    mean_gap_abs_max: float
    var_ratio_mean: float
    var_ratio_min: float
    var_ratio_max: float
    reference: dict[str, float]
    """The reference's summaries, flat groups included (``REFERENCE_SUMMARY_NAMES``)."""

    @property
    def multiplier(self) -> float:
        """The Lemma 4.2 multiplier of a typical group: the mean over groups with spread."""
        return self.inflation_mean


REFERENCE_VARIANCE_FLOOR = 1e-12
"""What the reference adds to sigma^2 in the Lemma 4.2 denominators."""
REFERENCE_SUMMARY_NAMES = {
    "inflation_mean": "inflation_factor_mean",
    "inflation_p95": "inflation_factor_p95",
    "inflation_max": "inflation_factor_max",
    "mean_gap_mean": "mean_gap_mean",
    "mean_gap_abs_mean": "mean_gap_abs_mean",
    "mean_gap_abs_max": "mean_gap_abs_max",
    "var_ratio_mean": "var_ratio_mean",
    "var_ratio_min": "var_ratio_min",
    "var_ratio_max": "var_ratio_max",
}
"""drmas's summary names -> the reference's (``adv_diag/<agent>/<name>``)."""


def agent_reward_stats(score: np.ndarray, agent: Any, *, uid: Any, traj_uid: Any) -> dict[str, AgentRewardStats]:
    """Per agent: the Lemma 4.2 multiplier and its two terms per (``uid``, agent) group,
    summarised over the groups (see :class:`AgentRewardStats`)."""
    score = np.asarray(score, dtype=np.float64)  # [N]
    _check_lengths(len(score), agent=agent, uid=uid, traj_uid=traj_uid)
    if len(score) == 0:
        return {}
    uid_code, n_uid = factorize(uid)  # [N]
    _, traj_score, traj_uid_code = _trajectory_scores(score, uid_code, traj_uid)  # [T]
    _, mu, sigma = _group_moments(traj_score, traj_uid_code, n_uid)  # [U]: what grpo uses
    agent_code, n_agent = factorize(agent)  # [N]
    group, n_group = combine_codes(uid_code, agent_code, n_agent)  # [N], S
    count, mu_k, sigma_k = _group_moments(score, group, n_group)  # [S]: what drmas uses
    group_uid = np.zeros(n_group, dtype=np.int64)  # [S]
    group_uid[group] = uid_code
    group_agent = np.full(n_group, -1, dtype=np.int64)  # [S]; -1: no row (an empty bin)
    group_agent[group] = agent_code
    var = sigma[group_uid] ** 2  # [S]
    # A variance at rounding level (every trajectory -0.1, say) is no spread, not a tiny one.
    spread = var > 1e-12 * np.maximum(1.0, mu[group_uid] ** 2)  # [S]
    with np.errstate(divide="ignore", invalid="ignore"):
        gap = mu_k - mu[group_uid]  # [S]
        var_ratio = sigma_k**2 / var  # [S]
        inflation = var_ratio + gap**2 / var  # [S]
    padded = var + REFERENCE_VARIANCE_FLOOR  # [S]: the reference's denominators
    reference_ratio = sigma_k**2 / padded  # [S]
    reference_inflation = reference_ratio + gap**2 / padded  # [S]
    names = code_names(agent, agent_code, n_agent)
    rows = np.bincount(agent_code, minlength=n_agent)  # [K]
    stats = {}
    for k in range(n_agent):
        if rows[k] == 0:
            continue
        mine = group_agent == k
        kept = mine & spread
        stats[names[k]] = AgentRewardStats(
            agent=names[k],
            rows=int(rows[k]),
            groups=int(mine.sum()),
            flat_groups=int((mine & ~spread).sum()),
            **_summaries(gap[kept], var_ratio[kept], inflation[kept]),
            reference={
                REFERENCE_SUMMARY_NAMES[key]: value
                for key, value in _summaries(gap[mine], reference_ratio[mine], reference_inflation[mine]).items()
            },
        )
    return stats


def _summaries(gap: np.ndarray, var_ratio: np.ndarray, inflation: np.ndarray) -> dict[str, float]:
    """The reference's per-agent summaries of the per-group terms (NaN over no group)."""
    if len(gap) == 0:
        return dict.fromkeys(
            (
                "inflation_mean",
                "inflation_p95",
                "inflation_max",
                "mean_gap_mean",
                "mean_gap_abs_mean",
                "mean_gap_abs_max",
                "var_ratio_mean",
                "var_ratio_min",
                "var_ratio_max",
            ),
            float("nan"),
        )
    return {
        "inflation_mean": float(inflation.mean()),
        "inflation_p95": float(np.percentile(inflation, 95)),
        "inflation_max": float(inflation.max()),
        "mean_gap_mean": float(gap.mean()),
        "mean_gap_abs_mean": float(np.abs(gap).mean()),
        "mean_gap_abs_max": float(np.abs(gap).max()),
        "var_ratio_mean": float(var_ratio.mean()),
        "var_ratio_min": float(var_ratio.min()),
        "var_ratio_max": float(var_ratio.max()),
    }


def advantage_second_moment_ratio(grpo: np.ndarray, drmas: np.ndarray, agent: Any) -> dict[str, float]:
    """Per agent, mean(A^2) under ``grpo`` over mean(A^2) under ``drmas``, on the same rows.

    The direct measurement of what the global baseline does to an agent's advantage scale
    (no lemma needed): the factor by which it scales the agent's advantage second moment,
    so about the square of the factor on its gradient norm. NaN where the agent's Dr. MAS
    advantages are all 0 (every group of its calls scored the same): undefined, not large.
    """
    grpo = np.asarray(grpo, dtype=np.float64)  # [N]
    drmas = np.asarray(drmas, dtype=np.float64)  # [N]
    _check_lengths(len(grpo), drmas=drmas, agent=agent)
    codes, n_agents = factorize(agent)  # [N], K
    names = code_names(agent, codes, n_agents)
    grpo_sq = np.bincount(codes, weights=grpo**2, minlength=n_agents)  # [K]
    drmas_sq = np.bincount(codes, weights=drmas**2, minlength=n_agents)  # [K]
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(drmas_sq > 0, grpo_sq / drmas_sq, np.nan)  # [K]; the row counts cancel
    return {names[k]: float(ratio[k]) for k in range(n_agents)}


# --------------------------------------------------------------------------------------
# Policy loss (torch)
# --------------------------------------------------------------------------------------
# torch is imported by the functions that use it: the advantage stage (numpy and Arrow
# only) then starts without it, which is seconds of every kfp task's start-up.


def aggregate_loss(
    values: torch.Tensor,
    mask: torch.Tensor,
    mode: LossAggregation = "token-mean",
    num_tokens: float | None = None,
) -> torch.Tensor:
    """Reduce per-token values [B, L] under the response mask [B, L] to a scalar.

    ``token-mean``: every token of the batch weighs the same. Pass ``num_tokens`` (the token
    count of the whole mini-batch) when the batch is split into micro-batches, so that the
    sum of the micro-batch losses equals the loss of the whole batch.
    ``token-mean-per-micro-batch``: the token mean of these values alone (``num_tokens`` is
    ignored); the caller averages over micro-batches, as veRL's gradient accumulation does.
    ``seq-mean-token-mean``: every sequence weighs the same (mean of per-sequence means).
    ``seq-mean-token-sum``: the mean over sequences of per-sequence sums.
    """
    import torch  # noqa: PLC0415

    mask = mask.to(values.dtype)
    if mode in ("token-mean", "token-mean-per-micro-batch"):
        whole = num_tokens is None or mode == "token-mean-per-micro-batch"
        denominator = mask.sum() if whole else torch.as_tensor(num_tokens)
        return (values * mask).sum() / denominator.clamp_min(1)
    per_sequence = (values * mask).sum(dim=-1)  # [B]
    if mode == "seq-mean-token-mean":
        per_sequence = per_sequence / mask.sum(dim=-1).clamp_min(1)
    elif mode != "seq-mean-token-sum":
        raise ValueError(f"unknown loss aggregation {mode!r}")
    return per_sequence.mean()


def low_var_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """The k3 estimator of KL(policy || reference), per token, clamped to [-10, 10].

    exp(ref - logp) - (ref - logp) - 1: unbiased, always >= 0, low variance (Schulman).
    """
    import torch  # noqa: PLC0415

    log_ratio = (ref_logprobs - logprobs).clamp(-20.0, 20.0)  # [B, L]
    return (torch.exp(log_ratio) - log_ratio - 1.0).clamp(-10.0, 10.0)


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    aggregation: LossAggregation = "token-mean",
    num_tokens: float | None = None,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The clipped PPO objective, with dual clip, optional KL and entropy terms.

    ``logprobs``, ``old_logprobs``, ``response_mask`` and ``entropy`` are [B, L];
    ``advantages`` is [B] (one value per row, put on every response token) or [B, L].
    Returns the loss to minimise and its metrics (floats): ``pg_loss``, ``clipfrac``
    (tokens where the clipped branch is taken), ``dual_clipfrac``, ``approx_kl``
    (old vs current, k1), and ``kl`` / ``entropy`` when those terms are on.
    """
    import torch  # noqa: PLC0415

    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)  # [B, 1] broadcasts over tokens
    log_ratio = (logprobs - old_logprobs).clamp(-20.0, 20.0)  # [B, L]
    ratio = torch.exp(log_ratio)  # [B, L]
    unclipped = -advantages * ratio  # [B, L]
    clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)  # [B, L]
    pessimistic = torch.maximum(unclipped, clipped)  # [B, L]
    dual_clipped = torch.minimum(pessimistic, -advantages * clip_ratio_c)  # [B, L]
    negative = (advantages < 0).expand_as(pessimistic)  # [B, L]
    per_token = torch.where(negative, dual_clipped, pessimistic)  # [B, L]

    def agg(values: torch.Tensor) -> torch.Tensor:
        return aggregate_loss(values, response_mask, aggregation, num_tokens)

    pg_loss = agg(per_token)
    loss = pg_loss
    with torch.no_grad():
        metrics = {
            "pg_loss": pg_loss.item(),
            "clipfrac": aggregate_loss((clipped > unclipped).float(), response_mask).item(),
            "dual_clipfrac": aggregate_loss((negative & (pessimistic > dual_clipped)).float(), response_mask).item(),
            "approx_kl": aggregate_loss(-log_ratio, response_mask).item(),
        }
    if ref_logprobs is not None and kl_coef != 0.0:
        kl = agg(low_var_kl(logprobs, ref_logprobs))
        loss = loss + kl_coef * kl
        metrics["kl"] = kl.item()
    if entropy is not None and entropy_coef != 0.0:
        mean_entropy = agg(entropy)
        loss = loss - entropy_coef * mean_entropy
        metrics["entropy"] = mean_entropy.item()
    return loss, metrics
