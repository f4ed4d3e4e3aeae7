"""Rows of a worker group's batch as tensors: packing into micro-batches, collation, this
rank's share, and the log-probs a model gives the response tokens."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from drmas.config import DrmasConfig

__all__ = ["MicroBatch", "collate", "micro_batches", "rank_batches", "sampling_temperatures", "token_logprobs"]


@dataclass
class MicroBatch:
    """Rows packed for one forward/backward; right-padded prompt + response sequences."""

    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    response_mask: torch.Tensor  # [B, L-1]: 1 where the next token is a response token
    old_logprobs: torch.Tensor  # [B, L-1], zero outside the response
    rollout_logprobs: torch.Tensor  # [B, L-1], the engine's (equal to old unless recomputed)
    advantages: torch.Tensor  # [B]
    agents: list[str]

    def to(self, device: torch.device) -> MicroBatch:
        """The same rows with every tensor on ``device`` (collate builds them on the CPU)."""
        return replace(
            self,
            input_ids=self.input_ids.to(device),
            attention_mask=self.attention_mask.to(device),
            response_mask=self.response_mask.to(device),
            old_logprobs=self.old_logprobs.to(device),
            rollout_logprobs=self.rollout_logprobs.to(device),
            advantages=self.advantages.to(device),
        )

    def select(self, rows: list[int]) -> MicroBatch:
        """Only ``rows`` (indices into this micro-batch), in that order."""
        index = torch.tensor(rows, dtype=torch.long, device=self.input_ids.device)
        return MicroBatch(
            input_ids=self.input_ids[index],
            attention_mask=self.attention_mask[index],
            response_mask=self.response_mask[index],
            old_logprobs=self.old_logprobs[index],
            rollout_logprobs=self.rollout_logprobs[index],
            advantages=self.advantages[index],
            agents=[self.agents[row] for row in rows],
        )


def micro_batches(rows: list[dict[str, Any]], max_rows: int, max_tokens: int | None) -> list[list[int]]:
    """Row indices packed in order: at most ``max_rows`` rows and ``max_tokens`` padded
    tokens (rows x longest sequence) per micro-batch; a longer row gets one to itself."""
    packs: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for index, row in enumerate(rows):
        length = len(row["prompt_ids"]) + len(row["response_ids"])
        grown = max(longest, length) * (len(current) + 1)
        if current and (len(current) >= max_rows or (max_tokens is not None and grown > max_tokens)):
            packs.append(current)
            current, longest = [], 0
        current.append(index)
        longest = max(longest, length)
    if current:
        packs.append(current)
    return packs


def collate(rows: list[dict[str, Any]], pad_id: int) -> MicroBatch:
    lengths = [len(r["prompt_ids"]) + len(r["response_ids"]) for r in rows]
    width = max(lengths)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    response = torch.zeros((len(rows), width - 1))
    old = torch.zeros((len(rows), width - 1))
    engine = torch.zeros((len(rows), width - 1))
    for b, row in enumerate(rows):
        prompt, answer = row["prompt_ids"], row["response_ids"]
        ids[b, : lengths[b]] = torch.tensor(prompt + answer, dtype=torch.long)
        attention[b, : lengths[b]] = 1
        # Token t+1 is predicted at position t: response token j sits at P+j, predicted at P+j-1.
        start, end = len(prompt) - 1, len(prompt) - 1 + len(answer)
        response[b, start:end] = 1.0
        engine[b, start:end] = torch.tensor(row["rollout_logprobs"], dtype=torch.float32)
        old[b, start:end] = torch.tensor(row.get("old_logprobs", row["rollout_logprobs"]), dtype=torch.float32)
    return MicroBatch(
        input_ids=ids,
        attention_mask=attention,
        response_mask=response,
        old_logprobs=old,
        rollout_logprobs=engine,
        advantages=torch.tensor([r["advantage"] for r in rows], dtype=torch.float32),
        agents=[r["agent"] for r in rows],
    )


def token_logprobs(
    model: torch.nn.Module,
    batch: MicroBatch,
    want_entropy: bool,
    temperature: torch.Tensor | None = None,
    chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(next token) [B, L-1] under ``model``, and the per-token entropy if asked;
    with ``temperature`` ([B], see ``sampling_temperatures``) of the logits divided by it.
    ``chunk``: positions per piece of the fp32 computation (``train.logprob_chunk_positions``).

    Only the positions from the batch's earliest response token on get logits (the model's
    ``logits_to_keep``, applied before the vocabulary projection); the positions before
    it are 0, as outside the response they are never read. The prompts are most of the
    tokens, and at a vocabulary of 49k (SmolLM2) their logits were most of the update's
    memory traffic."""
    start = first_response_position(batch.response_mask)
    # No KV cache: it is for generation, costs memory here and cannot be checkpointed.
    logits = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        use_cache=False,
        logits_to_keep=batch.input_ids.shape[1] - start,
    ).logits[:, :-1]
    scale = temperature.to(logits.device) if temperature is not None else torch.ones(len(logits), device=logits.device)
    targets = batch.input_ids[:, start + 1 :].to(logits.device)
    taken, entropy = _chunked_logprobs(logits, targets, scale, want_entropy, chunk)
    before = (len(logits), start)
    taken = torch.cat([taken.new_zeros(before), taken], dim=1)
    entropy = torch.cat([entropy.new_zeros(before), entropy], dim=1) if entropy is not None else None
    return taken, entropy


def first_response_position(response_mask: torch.Tensor) -> int:
    """The earliest position [0, L-1) that predicts a response token, over the rows; for a
    batch with no response token (a rank's empty micro-batch), the last one."""
    rows = response_mask.any(dim=1)
    if not bool(rows.any()):
        return response_mask.shape[1] - 1
    return int(response_mask[rows].argmax(dim=1).min())


def _chunked_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor, want_entropy: bool, chunk: int | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``_logprobs_of`` in pieces of ``chunk`` positions, each recomputed in the backward."""
    if chunk is None or chunk >= logits.shape[1]:
        return _logprobs_of(logits, targets, scale, want_entropy)
    pieces = [
        checkpoint(
            _logprobs_of,
            logits[:, start : start + chunk],
            targets[:, start : start + chunk],
            scale,
            want_entropy,
            use_reentrant=False,
        )
        for start in range(0, logits.shape[1], chunk)
    ]
    taken = torch.cat([piece[0] for piece in pieces], dim=1)
    entropy = torch.cat([piece[1] for piece in pieces], dim=1) if want_entropy else None
    return taken, entropy


def _logprobs_of(
    logits: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor, want_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The taken tokens' log-probs [B, P] and entropies of ``logits`` [B, P, V] / scale, in fp32."""
    log_probs = torch.log_softmax(logits.float() / scale[:, None, None], dim=-1)  # [B, P, V]
    taken = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # [B, P]
    entropy = -(log_probs.exp() * log_probs).sum(-1) if want_entropy else None  # [B, P]
    return taken, entropy


def sampling_temperatures(config: DrmasConfig, agents: list[str]) -> torch.Tensor:
    """Each row's rollout sampling temperature ([B]; greedy counts as 1, as the engines do).

    The rollout log-probs are of the distribution the engine sampled from, logits / T: the
    trainer's must be too, or at T != 1 the PPO ratio starts away from 1 and clips updates
    that should not be clipped (veRL divides the same way)."""
    return torch.tensor([config.agent_sampling(agent).temperature or 1.0 for agent in agents], dtype=torch.float32)


def rank_batches(
    rows: list[dict[str, Any]], packs: list[list[int]], pad_id: int, rank: int, world: int
) -> list[MicroBatch]:
    """This rank's micro-batches: every world-th pack, then empty ones (the last pack with
    its response mask zeroed: no loss, no gradient) up to the busiest rank's count. ZeRO's
    collectives in each forward and backward must line up across ranks: with one rank a
    micro-batch short, ZeRO-2 aborts and ZeRO-3 hangs."""
    batches = [collate([rows[i] for i in pack], pad_id) for pack in packs[rank::world]]
    busiest = -(-len(packs) // world)
    if len(batches) < busiest:
        last = collate([rows[i] for i in packs[-1]], pad_id)
        empty = replace(last, response_mask=torch.zeros_like(last.response_mask))
        batches += [empty] * (busiest - len(batches))
    return batches
