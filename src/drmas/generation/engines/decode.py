"""drmas's own decode loop for the transformers engine: what ``model.generate`` does for a
rollout batch, without the work a rollout does not need.

A rollout batch asks the same prompt ``group_size`` times (GRPO's group), and its responses
end at different lengths. ``model.generate`` prefills every copy of a prompt, keeps
decoding rows that have ended until the longest one does, keeps every step's full
vocabulary logits, and runs its logits processors over every row. Here, as inference
engines do (SGLang's prefix cache, vLLM's prefix caching and finished-request eviction):

- each distinct prompt is prefilled once, and its KV cache copied to the requests that ask
  it (``Cache.reorder_cache`` with repeated indices);
- the tokens all prompts start with (the system prompt, the template's head: 70 of ~120
  tokens of the word-problem Solver's prompts) are prefilled once, for all of them
  (``shared_prefix``; SGLang's radix cache shares prefixes the same way);
- a row that ends (a stop token) leaves the batch and the cache at once, so later steps run
  on the rows still decoding; the last rows move into the places it leaves (``drop_rows``),
  so that a departure copies the rows that move, not the whole cache;
- the log-prob of each sampled token is taken at its step; no logits are kept.

Sampling is what :class:`RequestSampler` draws: each request from its own generator (its
seed), so a response depends neither on its batch-mates nor on which rows have ended. The
log-prob is that of the sampled token under the temperature-scaled distribution (before
top-k/top-p), which is what the update recomputes.

Works with the cache API of transformers 5.12 (the GPU image) and 5.25: ``DynamicCache``,
``Cache.reorder_cache`` and the model's ``past_key_values``/``cache`` argument (renamed in
5.25, found from the forward's signature).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from drmas.config import SamplingConfig
from drmas.generation.engines.base import Generation
from drmas.generation.engines.fused import FusedDecoder, supports

__all__ = ["RequestSampler", "ReservedLayer", "decode", "drop_rows", "left_pad", "reserved_cache", "top_candidates"]


class RequestSampler:
    """Draws each row's next token from its request's generator, from the distribution
    ``model.generate`` samples: temperature, then top-k, then top-p (the smallest set of
    most likely tokens whose probability reaches ``top_p``, renormalised); greedy (argmax)
    at temperature 0.

    The nucleus is found among the few most likely tokens (``CANDIDATES``, more when they
    do not reach ``top_p``) instead of sorting the whole vocabulary of every row at every
    step, which cost more than the model's decode step (93 ms of a 16-row SmolLM2 step)."""

    CANDIDATES = 64

    def __init__(self, sampling: SamplingConfig, seeds: list[int], device: torch.device) -> None:
        self.greedy = sampling.temperature == 0
        self.temperature = 1.0 if self.greedy else sampling.temperature
        self.top_k = sampling.top_k
        self.top_p = sampling.top_p
        self.generators = [torch.Generator(device=device).manual_seed(seed) for seed in seeds]

    def draw(self, logits: torch.Tensor, requests: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The next token of each row (``requests[i]`` is row i's request) and its log-prob
        under the temperature-scaled distribution (before top-k/top-p: what the update
        recomputes): ``([A], [A])`` from ``[A, V]`` logits."""
        # A row-major float32 copy, whatever the logits' dtype and layout.
        scaled = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
        torch.div(logits, self.temperature, out=scaled)
        normaliser = torch.logsumexp(scaled, dim=-1, keepdim=True)  # [A, 1]
        if self.greedy:
            tokens = scaled.argmax(dim=-1)
        else:
            probs, candidates = self._nucleus(scaled, normaliser)
            picks = [
                torch.multinomial(probs[row], 1, generator=self.generators[request])
                for row, request in enumerate(requests)
            ]
            tokens = candidates.gather(-1, torch.stack(picks)).squeeze(-1)
        return tokens, (scaled.gather(-1, tokens.unsqueeze(-1)) - normaliser).squeeze(-1)

    def _nucleus(self, scaled: torch.Tensor, normaliser: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The sampling probabilities ``[A, K]`` over each row's ``K`` most likely tokens
        (their ids ``[A, K]``), zero outside top-k and the top-p nucleus."""
        vocab = scaled.shape[-1]
        if self.top_p >= 1.0 and not self.top_k:  # the whole distribution
            return (scaled - normaliser).exp(), torch.arange(vocab, device=scaled.device).expand_as(scaled)
        limit = min(self.top_k, vocab) if self.top_k else vocab
        count = limit if self.top_p >= 1.0 else min(self.CANDIDATES, limit)
        while True:
            top, candidates = top_candidates(scaled, count)  # sorted, most likely first
            probs = (top - normaliser).exp()
            if self.top_k:
                probs = probs / probs.sum(dim=-1, keepdim=True)  # top-k renormalises first
            if self.top_p >= 1.0:
                return probs, candidates
            before = probs.cumsum(dim=-1) - probs  # the mass of the more likely tokens
            if count == limit or bool((before[:, -1] + probs[:, -1] >= self.top_p).all()):
                break
            count = min(count * 4, limit)
        keep = before < self.top_p  # the first token always stays
        return probs * keep, candidates


CHUNK = 64
"""Vocabulary entries per chunk in ``top_candidates``."""


def top_candidates(scores: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``scores.topk(count)`` (values and ids, largest first) in half its time on a large
    vocabulary: the ``count`` largest scores lie in the ``count`` chunks of ``CHUNK``
    entries with the largest maxima (a score among them has at most ``count - 1`` above
    it, so at most that many chunks have a larger maximum than its own), so only those
    chunks are searched."""
    rows, vocab = scores.shape
    if vocab % CHUNK or count * CHUNK * 4 > vocab:
        return scores.topk(count, dim=-1)
    maxima = scores.view(rows, vocab // CHUNK, CHUNK).amax(dim=-1)
    chunks = maxima.topk(count, dim=-1).indices  # [A, count]
    ids = (chunks.unsqueeze(-1) * CHUNK + torch.arange(CHUNK, device=scores.device)).view(rows, count * CHUNK)
    top, where = scores.gather(-1, ids).topk(count, dim=-1)
    return top, ids.gather(-1, where)


@torch.no_grad()
def decode(
    model: torch.nn.Module,
    prompts: list[list[int]],
    sampling: SamplingConfig,
    stop_ids: list[int],
    seeds: list[int],
    fused: bool = True,
) -> list[Generation]:
    """Sample a response to every prompt (``seeds[i]`` seeding request i), up to
    ``sampling.max_new_tokens`` tokens or a stop token (kept). The decode steps go through
    ``FusedDecoder`` where it knows the model (unless ``fused`` is false), through the
    model's forward otherwise."""
    device = next(model.parameters()).device
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else stop_ids[0]
    distinct = list(dict.fromkeys(tuple(prompt) for prompt in prompts))
    prompt_row = {prompt: row for row, prompt in enumerate(distinct)}
    cache = reserved_cache(model, max(len(prompt) for prompt in distinct) + sampling.max_new_tokens)
    forward = _forward_with(model, cache)
    logits, attention_mask = _prefill(forward, cache, distinct, pad_id, device)
    step_with = FusedDecoder(model) if fused and supports(model) and _reserved(cache) else None
    # One row per request from here on: the prompt's prefill, copied.
    copies = torch.tensor([prompt_row[tuple(prompt)] for prompt in prompts], device=device)
    cache.reorder_cache(copies)
    logits, attention_mask = logits[copies], attention_mask[copies]
    next_position = attention_mask.sum(dim=-1)  # [A]: the first response token's position
    sampler = RequestSampler(sampling, seeds, device)
    stops = torch.tensor(sorted(set(stop_ids)), device=device)
    active = list(range(len(prompts)))  # the request of each row still decoding
    responses: list[list[int]] = [[] for _ in prompts]
    logprobs: list[list[float]] = [[] for _ in prompts]
    for step in range(sampling.max_new_tokens):
        tokens, token_logprobs = sampler.draw(logits, active)
        for request, token, logprob in zip(active, tokens.tolist(), token_logprobs.tolist(), strict=True):
            responses[request].append(token)
            logprobs[request].append(logprob)
        going = ~torch.isin(tokens, stops)
        if step == sampling.max_new_tokens - 1 or not bool(going.any()):
            break
        if not bool(going.all()):  # the ended rows leave the batch and the cache
            order = drop_rows(cache, going.nonzero().squeeze(-1).tolist())
            active = [active[row] for row in order]
            index = torch.tensor(order, device=device)
            tokens, attention_mask, next_position = tokens[index], attention_mask[index], next_position[index]
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones((len(active), 1))], dim=-1)
        if step_with is None:
            logits = forward(tokens.unsqueeze(-1), attention_mask, next_position.unsqueeze(-1))
        else:
            logits = step_with.step(tokens, next_position, attention_mask, cache)
        next_position = next_position + 1
    stop_set = set(stop_ids)
    return [
        Generation(ids, lps, "stop" if ids and ids[-1] in stop_set else "length")
        for ids, lps in zip(responses, logprobs, strict=True)
    ]


def drop_rows(cache: DynamicCache, keep: list[int]) -> list[int]:
    """Keep only the batch rows ``keep`` (ascending) of ``cache``; returns the new order:
    row j now holds what row ``order[j]`` held. A kept row among the first ``len(keep)``
    stays where it is; each later kept row moves into a place an ended row leaves. A
    ``ReservedLayer`` copies only the rows that move (``ReservedLayer.move_rows``; a
    reorder would copy every kept row's whole room: ~13 MB a row for SmolLM2-135M with
    ~300 positions); any other layer is reordered."""
    count = len(keep)
    holes = iter(sorted(set(range(count)) - set(keep)))
    order = list(range(count))
    for row in keep:
        if row >= count:
            order[next(holes)] = row
    index: torch.Tensor | None = None
    for layer in cache.layers:
        if isinstance(layer, ReservedLayer):
            layer.move_rows(order)
        else:
            if index is None:
                index = torch.tensor(order, device=layer.keys.device)
            layer.reorder_cache(index)
    return order


SHARED_PREFIX_MIN_SAVED = 128
"""Prefill a prefix shared by the distinct prompts once only when that saves at least this
many token positions: the extra forward call costs about what a few dozen tokens do on CPU
(per-op overhead, ~60 ms for SmolLM2's 30 layers)."""


def shared_prefix(prompts: list[tuple[int, ...]]) -> int:
    """How many leading tokens every prompt has in common, each keeping at least one token
    of its own (whose logits give its first response token)."""
    shortest = min(len(prompt) for prompt in prompts)
    length = 0
    while length < shortest - 1 and all(prompt[length] == prompts[0][length] for prompt in prompts):
        length += 1
    return length


def _prefill(
    forward: Callable[..., torch.Tensor],
    cache: DynamicCache,
    prompts: list[tuple[int, ...]],
    pad_id: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the distinct ``prompts`` into ``cache``: their next-token logits ``[D, V]`` and
    attention mask ``[D, width]``. A prefix they share (``shared_prefix``) goes through the
    model once and is copied to every row; each row's own tokens follow it, left-padded
    after it (positions counted on, the padding masked out)."""
    shared = shared_prefix(prompts) if len(prompts) > 1 else 0
    if shared * (len(prompts) - 1) < SHARED_PREFIX_MIN_SAVED:
        input_ids, attention_mask = left_pad([list(prompt) for prompt in prompts], pad_id, device)
        return forward(input_ids, attention_mask, _positions(attention_mask)), attention_mask
    head = torch.tensor([prompts[0][:shared]], device=device)
    forward(head, torch.ones_like(head), torch.arange(shared, device=device)[None])
    cache.reorder_cache(torch.zeros(len(prompts), dtype=torch.long, device=device))
    input_ids, own_mask = left_pad([list(prompt[shared:]) for prompt in prompts], pad_id, device)
    attention_mask = torch.cat([own_mask.new_ones((len(prompts), shared)), own_mask], dim=-1)
    logits = forward(input_ids, attention_mask, shared + _positions(own_mask))
    return logits, attention_mask


class ReservedLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys and values are written into room reserved once for
    the longest sequence, instead of concatenated into new tensors at every step: on CPU
    the copy and allocation of the growing cache took 62% of a 16-row SmolLM2 decode step.
    ``keys``/``values`` are views of the room's first rows (those of the batch), so every
    reader of a ``DynamicLayer`` works as before; ``reorder_cache`` (a prompt's prefill
    copied to its requests) selects rows of the room, ``move_rows`` (ended rows leaving)
    moves the few rows that change place."""

    def __init__(self, room: int) -> None:
        super().__init__()
        self.room = room
        self.key_room: torch.Tensor | None = None
        self.value_room: torch.Tensor | None = None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start = self.get_seq_length()
        end = start + key_states.shape[-2]
        if self.key_room is None or self.key_room.shape[-2] < end:
            self.key_room = self._reserve(self.keys, key_states, start, end)
            self.value_room = self._reserve(self.values, value_states, start, end)
        rows = key_states.shape[0]
        self.key_room[:rows, :, start:end] = key_states
        self.value_room[:rows, :, start:end] = value_states
        self.keys, self.values = self.key_room[:rows, :, :end], self.value_room[:rows, :, :end]
        return self.keys, self.values

    def _reserve(self, kept: torch.Tensor, new: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Room for ``max(room, end)`` positions, holding the ``start`` kept ones."""
        shape = (*new.shape[:-2], max(self.room, end), new.shape[-1])
        room = new.new_empty(shape)
        if start:
            room[:, :, :start] = kept
        return room

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.key_room is not None and self.value_room is not None:
            length = self.get_seq_length()
            self.key_room = self.key_room.index_select(0, beam_idx.to(self.key_room.device))
            self.value_room = self.value_room.index_select(0, beam_idx.to(self.value_room.device))
            self.keys, self.values = self.key_room[:, :, :length], self.value_room[:, :, :length]

    def move_rows(self, order: list[int]) -> None:
        """The batch becomes rows ``order`` of the current one, where ``order[j]`` is j or
        a row past the new batch's end (``drop_rows``): only those rows are copied."""
        if self.key_room is None or self.value_room is None:
            return
        length = self.get_seq_length()
        moves = [(target, source) for target, source in enumerate(order) if target != source]
        if moves:
            targets, sources = (torch.tensor(side, device=self.key_room.device) for side in zip(*moves, strict=True))
            self.key_room[targets, :, :length] = self.key_room[sources, :, :length]
            self.value_room[targets, :, :length] = self.value_room[sources, :, :length]
        rows = len(order)
        self.keys, self.values = self.key_room[:rows, :, :length], self.value_room[:rows, :, :length]


def _reserved(cache: DynamicCache) -> bool:
    """Whether every layer of ``cache`` keeps full attention in reserved room."""
    return all(type(layer) is ReservedLayer for layer in cache.layers)


def reserved_cache(model: torch.nn.Module, room: int) -> DynamicCache:
    """The model's ``DynamicCache``, its full-attention layers holding ``room`` positions
    reserved (``ReservedLayer``); sliding-window and other layers stay as transformers
    made them."""
    cache = DynamicCache(config=model.config)
    cache.layers = [ReservedLayer(room) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def left_pad(prompts: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts right-aligned in one ``[B, P]`` batch, and its attention mask."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        mask[row, width - len(prompt) :] = 1
    return ids.to(device), mask.to(device)


def _positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Each token's position counted from its row's first real token (left padding)."""
    return (attention_mask.cumsum(dim=-1) - 1).clamp(min=0)


def _forward_with(model: torch.nn.Module, cache: DynamicCache) -> Callable[..., torch.Tensor]:
    """A step of ``model`` over ``cache``: (input ids, attention mask, position ids) -> the
    next-token logits ``[B, V]``, the cache extended by the ids."""
    argument = _cache_argument(model)

    def forward(input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        out = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            logits_to_keep=1,
            **{argument: cache},
        )
        return out.logits[:, -1]

    return forward


def _cache_argument(model: torch.nn.Module) -> str:
    """The forward's name for the KV cache: ``cache`` from transformers 5.25 on (where
    ``past_key_values`` is deprecated), ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
