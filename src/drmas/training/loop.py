"""One worker group's optimizer steps over its rows: the mini-batches, each micro-batch's
share of the loss, the per-agent gradient-norm diagnostic and recomputed old log-probs."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from drmas.algos import LossAggregation, aggregate_loss, policy_loss
from drmas.config import DrmasConfig
from drmas.infra.progress import Progress
from drmas.training.batching import (
    MicroBatch,
    collate,
    micro_batches,
    rank_batches,
    sampling_temperatures,
    token_logprobs,
)
from drmas.training.engines import TrainEngine, full_shape

__all__ = ["MiniBatchSize", "rows_with_gradient", "train_worker_group"]


@dataclass(frozen=True)
class MiniBatchSize:
    """The whole mini-batch (all ranks), which every micro-batch's loss is normalised by."""

    tokens: int  # response tokens
    rows: int
    micro_batches: int


def train_worker_group(
    config, group, engine, model, ref_model, rows, pad_id, iteration, rank, world
) -> dict[str, float]:
    """``updates_per_iteration`` optimizer steps over the rows; returns the wg's metrics."""
    train, algorithm = config.train, config.algorithm
    order = np.random.default_rng([config.experiment.seed, iteration, len(rows)]).permutation(len(rows))
    steps = min(train.updates_per_iteration, len(rows))
    totals: dict[str, float] = {
        "loss": 0.0,
        "clipfrac": 0.0,
        "approx_kl": 0.0,
        "entropy": 0.0,
        "kl": 0.0,
        "logprob_gap": 0.0,
    }
    norms, skipped, tokens = [], 0, 0
    agent_norms: dict[str, list[float]] = {}
    minis = [[rows[i] for i in mini] for mini in np.array_split(order, steps)]
    trained = [rows_with_gradient(mini_rows, config) for mini_rows in minis]
    if train.recompute_old_logprobs:
        _recompute_old_logprobs(
            model,
            [row for kept in trained for row in kept],
            pad_id,
            group.micro_batch_size,
            train.max_tokens_per_micro_batch,
            config,
            engine.device,
        )
    packed = [micro_batches(kept, group.micro_batch_size, train.max_tokens_per_micro_batch) for kept in trained]
    # Every rank runs the busiest rank's count of micro-batches (rank_batches).
    progress = Progress(
        sum(-(-len(packs) // world) for packs in packed),
        f"update {group.name}",
        unit="micro-batch",
        final_line=False,
        shown=rank == 0,
    )
    for step_index, (mini_rows, kept, packs) in enumerate(zip(minis, trained, packed, strict=True)):
        size = MiniBatchSize(_response_tokens(mini_rows), len(mini_rows), len(packs))
        kept_tokens = _response_tokens(kept)
        batches = [batch.to(engine.device) for batch in rank_batches(kept, packs, pad_id, rank, world)]
        if config.diagnostics.per_agent_grad_norm:
            agents = sorted({row["agent"] for row in mini_rows})
            for agent, norm in _agent_grad_norms(
                engine, model, ref_model, agents, batches, size, config, world
            ).items():
                agent_norms.setdefault(agent, []).append(norm)
        for index, batch in enumerate(batches):
            loss, stats = _forward_backward(engine, ref_model, batch, size, config, boundary=index == len(batches) - 1)
            totals["loss"] += loss.item() / steps
            weight = batch.response_mask.sum().item() / max(kept_tokens, 1)  # metrics: over the rows trained
            for key, value in stats.items():
                if key == "logprob_gap":  # rollout engine vs trainer: only before any step
                    totals[key] += value * weight if step_index == 0 else 0.0
                else:
                    totals[key] += value * weight / steps
            progress.update(step=f"{step_index + 1}/{steps}")
        stepped, norm = engine.step(engine.grad_norm())
        skipped += int(not stepped or not math.isfinite(norm))
        norms.append(norm)
        tokens += kept_tokens
    progress.close()
    if world > 1:  # each rank saw its share of the micro-batches: sum the shares
        shares = torch.tensor(list(totals.values()), dtype=torch.float64, device=engine.device)  # nccl: on the GPU
        dist.all_reduce(shares, op=dist.ReduceOp.SUM)
        totals = dict(zip(totals, shares.tolist(), strict=True))
    prefix = f"wg/{group.name}"
    metrics = {f"{prefix}/{key}": value for key, value in totals.items()}
    metrics |= {
        f"{prefix}/grad_norm": float(np.mean(norms)),
        f"{prefix}/grad_norm_max": float(np.max(norms)),
        f"{prefix}/skipped": float(skipped),
        f"{prefix}/steps": float(steps),
        f"{prefix}/tokens": float(tokens),
        f"{prefix}/rows": float(len(rows)),
        f"{prefix}/rows_trained": float(sum(len(kept) for kept in trained)),
        f"{prefix}/lr": engine.lr(),
    }
    if engine.device.type == "cuda":  # the whole update process's peak, loading included
        metrics[f"{prefix}/peak_memory_gib"] = torch.cuda.max_memory_allocated(engine.device) / 2**30
    for agent, values in agent_norms.items():
        metrics[f"agent/{agent}/grad_norm"] = float(np.mean(values))
    if algorithm.kl_coef == 0.0:
        metrics.pop(f"{prefix}/kl")
    return metrics


def rows_with_gradient(rows: list[dict[str, Any]], config: DrmasConfig) -> list[dict[str, Any]]:
    """The rows of a mini-batch that go through the model: those whose loss has a gradient.

    A row whose advantage is exactly 0 adds exactly 0 to the clipped objective's gradient
    (both branches are -A x ratio), so it is left out when the loss has no KL or entropy
    term (which every row feeds) and its normaliser does not depend on how the rows are
    packed (every aggregation but ``token-mean-per-micro-batch``): the mini-batch's token
    and row counts still count every row, so the step is the one the whole mini-batch
    gives. A GRPO group whose episodes all scored alike is all zeros: two rows in three
    in the SmolLM2 word-problem runs. One row (the shortest) stays when none has a
    gradient, so that the step still runs, as it would have, and moves by its momentum.
    """
    algorithm = config.algorithm
    if algorithm.kl_coef != 0.0 or algorithm.entropy_coef != 0.0:
        return rows
    if algorithm.loss_aggregation == "token-mean-per-micro-batch":
        return rows
    kept = [row for row in rows if row["advantage"] != 0.0]
    return kept or [min(rows, key=lambda row: len(row["prompt_ids"]) + len(row["response_ids"]))]


def _response_tokens(rows: list[dict[str, Any]]) -> int:
    return sum(len(row["response_ids"]) for row in rows)


def _agent_grad_norms(
    engine: TrainEngine,
    model,
    ref_model,
    agents: list[str],
    batches: list[MicroBatch],
    size: MiniBatchSize,
    config: DrmasConfig,
    world: int,
) -> dict[str, float]:
    """Per agent of the mini-batch (``agents``, the same list on every rank), the L2 norm
    of the gradient of its share of the loss: its rows' terms, normalised as in the update,
    summed over this rank's micro-batches and then over ranks. The agents' gradients add
    up to the update's (before clipping).

    The gradients come from ``torch.autograd.grad`` into a buffer of their own: they never
    reach ``p.grad``, DeepSpeed's gradient hooks or ZeRO's partitioned buffers, so the
    update is the same with the diagnostic on or off. ZeRO-3 gathers each module's
    parameters for its backward as usual, so the gradients are whole on every rank. Costs
    one forward and backward per agent and micro-batch, and one gradient-sized fp32 buffer.
    """
    norms = {}
    with engine.side_pass():
        for agent in agents:
            losses = (
                micro_loss(model, ref_model, batch, size, config, want_entropy=False, only_agent=agent)[0]
                for batch in batches
            )
            gradient = _gradient_sum(engine.params, losses, engine.device)
            if world > 1:
                dist.all_reduce(gradient, op=dist.ReduceOp.SUM)
            norms[agent] = float(torch.linalg.vector_norm(gradient))
    return norms


def _gradient_sum(
    params: list[torch.nn.Parameter], losses: Iterable[torch.Tensor], device: torch.device
) -> torch.Tensor:
    """The gradient of the sum of ``losses`` w.r.t. ``params``, flat and in fp32 on
    ``device``, one loss (one graph) at a time; ``p.grad`` and every gradient hook stay
    untouched."""
    sizes = [math.prod(full_shape(p)) for p in params]
    total = torch.zeros(sum(sizes), dtype=torch.float32, device=device)
    parts = total.split(sizes)
    for loss in losses:
        for part, grad in zip(parts, torch.autograd.grad(loss, params, allow_unused=True), strict=True):
            if grad is not None:  # a parameter this loss does not use contributes nothing
                part.add_(grad.reshape(-1))
    return total


def _recompute_old_logprobs(
    model, rows, pad_id, max_rows, max_tokens, config: DrmasConfig, device: torch.device
) -> None:
    """The old policy's log-probs by the trainer itself, before any step (one no-grad pass
    on ``device``), instead of the rollout engine's: removes engine/trainer numerical
    mismatch."""
    with torch.no_grad():
        for pack in micro_batches(rows, max_rows, max_tokens):
            batch = collate([rows[i] for i in pack], pad_id).to(device)
            logprobs, _ = token_logprobs(
                model,
                batch,
                want_entropy=False,
                temperature=sampling_temperatures(config, batch.agents),
                chunk=config.train.logprob_chunk_positions,
            )
            for b, index in enumerate(pack):
                rows[index]["old_logprobs"] = logprobs[b][batch.response_mask[b] > 0].tolist()


def _forward_backward(
    engine: TrainEngine, ref_model, batch: MicroBatch, size: MiniBatchSize, config: DrmasConfig, boundary: bool
) -> tuple[torch.Tensor, dict[str, float]]:
    """One micro-batch's loss and its gradient, accumulated into the engine's (``boundary``:
    the mini-batch's last micro-batch). Returns the loss and its metrics."""
    loss, stats = micro_loss(engine.forward_model, ref_model, batch, size, config, want_entropy=True)
    engine.backward(loss, boundary=boundary)
    return loss, stats


def micro_loss(
    model,
    ref_model,
    batch: MicroBatch,
    size: MiniBatchSize,
    config: DrmasConfig,
    want_entropy: bool,
    only_agent: str | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The micro-batch's share of the mini-batch loss (the shares add up to it) and its
    token-mean metrics; with ``only_agent``, the share of that agent's rows alone,
    normalised the same way, so that the agents' shares add up to the micro-batch's."""
    algorithm = config.algorithm
    aggregation, num_tokens, factor = _normalisation(algorithm.loss_aggregation, batch, size)
    mask = batch.response_mask
    if only_agent is not None:
        batch, mask, factor = _agent_rows(batch, only_agent, num_tokens, factor, size)
    temperature = sampling_temperatures(config, batch.agents)
    chunk = config.train.logprob_chunk_positions
    logprobs, entropy = token_logprobs(model, batch, want_entropy or algorithm.entropy_coef > 0, temperature, chunk)
    ref = None
    if ref_model is not None:
        with torch.no_grad():
            ref, _ = token_logprobs(ref_model, batch, want_entropy=False, temperature=temperature, chunk=chunk)
    loss, stats = policy_loss(
        logprobs,
        batch.old_logprobs,
        batch.advantages,
        mask,
        clip_ratio_low=algorithm.clip_ratio_low,
        clip_ratio_high=algorithm.clip_ratio_high,
        clip_ratio_c=algorithm.clip_ratio_c,
        aggregation=aggregation,
        num_tokens=num_tokens,
        ref_logprobs=ref,
        kl_coef=algorithm.kl_coef,
        entropy=entropy if algorithm.entropy_coef > 0 else None,
        entropy_coef=algorithm.entropy_coef,
    )
    with torch.no_grad():
        result = {
            "clipfrac": stats["clipfrac"],
            "approx_kl": stats["approx_kl"],
            "logprob_gap": aggregate_loss((logprobs.detach() - batch.rollout_logprobs).abs(), mask).item(),
        }
        if entropy is not None:
            result["entropy"] = aggregate_loss(entropy.detach(), mask).item()
        if "kl" in stats:
            result["kl"] = stats["kl"]
    return loss * factor, result


def _agent_rows(
    batch: MicroBatch, agent: str, num_tokens: int | None, factor: float, size: MiniBatchSize
) -> tuple[MicroBatch, torch.Tensor, float]:
    """The rows of ``agent`` alone, their response mask, and the factor that keeps their
    loss normalised as in the whole micro-batch (the seq-mean modes average over rows, so
    their weight is the rows kept; the token modes' ``num_tokens`` is the micro-batch's).
    Only those rows go through the model: the agents' passes together cost one pass of the
    micro-batch, not one each. An agent with no row here gets one row, masked out: a pass
    that adds nothing, so that every rank runs as many passes (ZeRO-3 gathers in them)."""
    rows = [row for row, name in enumerate(batch.agents) if name == agent]
    if not rows:
        return batch.select([0]), torch.zeros_like(batch.response_mask[:1]), 0.0
    if num_tokens is None:
        factor = len(rows) / size.rows
    selected = batch.select(rows)
    return selected, selected.response_mask, factor


def _normalisation(
    mode: LossAggregation, batch: MicroBatch, size: MiniBatchSize
) -> tuple[LossAggregation, int | None, float]:
    """(aggregation, num_tokens, factor) that make ``policy_loss`` x factor a micro-batch's
    share of the mini-batch's loss.

    token-mean: every response token of the mini-batch weighs 1 / its token count.
    token-mean-per-micro-batch: the micro-batch's token mean over the number of
    micro-batches of the mini-batch, all ranks together (veRL's gradient accumulation); its
    denominator is the micro-batch's whole token count, also for one agent's share.
    seq-mean-*: the mean over the micro-batch's rows, weighted by its share of the rows.
    """
    if mode == "token-mean":
        return mode, size.tokens, 1.0
    if mode == "token-mean-per-micro-batch":
        return "token-mean", int(batch.response_mask.sum().item()), 1.0 / size.micro_batches
    return mode, None, len(batch.agents) / size.rows
