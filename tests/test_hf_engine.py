"""The transformers engine on a real tiny model: one seed per request (so a data-parallel
split of a batch samples what the whole batch samples), and weights taken in memory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from drmas.config import ModelSpec, SamplingConfig
from drmas.generation.engines import request_seeds
from drmas.generation.engines.hf import HFEngine
from drmas.models import build_scratch_policy, load_model

SAMPLING = SamplingConfig(temperature=1.0, top_p=0.9, top_k=50, max_new_tokens=12)
PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13], [14]]


@pytest.fixture(scope="module")
def policy(tmp_path_factory) -> Path:
    spec = ModelSpec(hidden_size=32, intermediate_size=64, num_layers=1, vocab_size=120)
    texts = [f"what is {a} plus {b}? it is {a + b}." for a in range(30) for b in range(10)]
    return build_scratch_policy(spec, texts, tmp_path_factory.mktemp("policy"), seed=0)


def _engine(policy: Path) -> HFEngine:
    engine = HFEngine("float32")
    engine.load(policy)
    return engine


def test_each_request_samples_alike_whatever_batch_it_is_in(policy):
    engine = _engine(policy)
    whole = engine.generate(PROMPTS, SAMPLING, stop_ids=[0], seeds=request_seeds(7, 0, 4))
    head = engine.generate(PROMPTS[:1], SAMPLING, stop_ids=[0], seeds=request_seeds(7, 0, 1))
    tail = engine.generate(PROMPTS[1:], SAMPLING, stop_ids=[0], seeds=request_seeds(7, 1, 3))
    assert [g.response_ids for g in head + tail] == [g.response_ids for g in whole]
    engine.MAX_ROWS = 3  # a call larger than a decode's rows goes in chunks, sampling alike
    assert [g.response_ids for g in engine.generate(PROMPTS, SAMPLING, [0], request_seeds(7, 0, 4))] == [
        g.response_ids for g in whole
    ]
    other = engine.generate(PROMPTS, SAMPLING, stop_ids=[0], seeds=request_seeds(8, 0, 4))
    assert [g.response_ids for g in other] != [g.response_ids for g in whole]
    # The log-probs are those of the tokens sampled, at the sampling temperature.
    assert all(len(g.logprobs) == len(g.response_ids) and max(g.logprobs) <= 0 for g in whole)


def test_weights_taken_in_memory_are_generated_from_and_survive_an_offload(policy):
    engine = _engine(policy)
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=8)
    before = engine.generate(PROMPTS, greedy, stop_ids=[0], seeds=[0] * 4)
    model = load_model(policy)
    with torch.no_grad():
        for parameter in model.parameters():  # tied weights (the output embedding) move together
            parameter.add_(0.5 * torch.randn_like(parameter))
    changed = model.state_dict()
    engine.set_weights(changed)
    after = engine.generate(PROMPTS, greedy, stop_ids=[0], seeds=[0] * 4)
    assert [g.response_ids for g in after] != [g.response_ids for g in before]
    engine.offload()
    assert not engine.resident
    assert engine.generate(PROMPTS, greedy, stop_ids=[0], seeds=[0] * 4) == after
    assert all(torch.equal(engine.model.state_dict()[name], changed[name]) for name in changed)


def test_weights_that_do_not_fit_the_model_are_refused(policy):
    engine = _engine(policy)
    weights = load_model(policy).state_dict()
    weights["not.a.weight"] = torch.zeros(1)
    with pytest.raises(ValueError, match=r"unknown \['not.a.weight'\]"):
        engine.set_weights(weights)
    del weights["not.a.weight"], weights["model.norm.weight"]
    weights = {name: tensor + 1.0 for name, tensor in weights.items()}
    with pytest.raises(ValueError, match="missing.*model.norm.weight"):
        engine.set_weights(weights)
    # Refused before anything was copied: the engine still holds the policy it loaded.
    loaded = load_model(policy).state_dict()
    assert all(torch.equal(tensor, loaded[name]) for name, tensor in engine.model.state_dict().items())


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(0.7, 0, 0.95), (1.0, 50, 0.9), (1.3, 0, 0.999), (0.7, 20, 1.0), (1.0, 0, 1.0)],
)
def test_the_sampler_draws_from_the_distribution_transformers_warpers_give(temperature, top_k, top_p):
    """The sampling probabilities over each row's candidates equal, scattered back to the
    vocabulary, softmax of transformers' own temperature -> top-k -> top-p warpers; a flat
    row (its nucleus larger than the first candidates) and a peaked one are both covered."""
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    from drmas.generation.engines.decode import RequestSampler

    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 500, generator=generator) * torch.tensor([[0.1], [3.0], [8.0]])
    sampler = RequestSampler(
        SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p), [1, 2, 3], torch.device("cpu")
    )
    scaled = logits / temperature
    probs, candidates = sampler._nucleus(scaled, torch.logsumexp(scaled, dim=-1, keepdim=True))
    ours = torch.zeros_like(logits).scatter_add_(-1, candidates, probs)
    ours = ours / ours.sum(dim=-1, keepdim=True)
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    assert torch.allclose(ours, torch.softmax(scores, dim=-1), atol=1e-6)
    tokens, logprobs = sampler.draw(logits, [0, 1, 2])
    assert all(ours[row, token] > 0 for row, token in enumerate(tokens.tolist()))
    expected = torch.log_softmax(logits / temperature, dim=-1).gather(-1, tokens[:, None])[:, 0]
    assert torch.allclose(logprobs, expected, rtol=0, atol=1e-6)  # logit - logsumexp: float32 rounding


def _generate_greedily(model, prompts: list[list[int]], max_new_tokens: int):
    """transformers' own greedy ``generate`` on the left-padded batch (pad 0, no stop
    token), with every step's logits: the reference the decode loop is held to. Returns
    (the padded prompt width, generate's output)."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return width, model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=max_new_tokens,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
        eos_token_id=None,
    )


def test_greedy_decoding_is_what_model_generate_gives_with_rows_ending_apart(policy):
    """The engine's decode loop (each distinct prompt prefilled once, ended rows leaving the
    batch, the cache written into reserved room) against transformers' own ``generate`` on
    the same left-padded batch: the same tokens, and log-probs those of generate's logits."""
    engine = _engine(policy)
    prompts = [*PROMPTS, PROMPTS[0], PROMPTS[2]]  # two prompts asked twice
    width, reference = _generate_greedily(engine.model, prompts, 12)
    tokens = reference.sequences[:, width:]
    # A stop token that ends some rows early and others not at all, so that rows leave the batch apart.
    stop = tokens[0, 3].item()
    ends = [(row == stop).nonzero()[0].item() + 1 if (row == stop).any() else 12 for row in tokens]
    assert len(set(ends)) > 1, ends
    out = engine.generate(prompts, SamplingConfig(temperature=0.0, max_new_tokens=12), stop_ids=[stop], seeds=[0] * 6)
    logprobs = torch.stack([torch.log_softmax(step.float(), dim=-1) for step in reference.logits], dim=1)
    for row, generation in enumerate(out):
        assert generation.response_ids == tokens[row, : ends[row]].tolist()
        assert generation.finish_reason == ("stop" if ends[row] < 12 or tokens[row, 11] == stop else "length")
        expected = logprobs[row, : ends[row]].gather(-1, tokens[row, : ends[row], None])[:, 0]
        assert torch.allclose(torch.tensor(generation.logprobs), expected, atol=1e-5)


def test_a_prefix_every_prompt_shares_is_prefilled_once_and_decodes_as_model_generate(policy):
    """Prompts that start alike (a system prompt): the shared tokens go through the model
    once, each prompt's own tokens after them. Greedy tokens are what ``model.generate``
    gives on the left-padded batch; log-probs within float noise of its logits."""
    from drmas.generation.engines import decode as decoding

    engine = _engine(policy)
    head = [(7 * i) % 100 + 5 for i in range(40)]
    own = [[50, 51, 52], [60], [70, 71, 72, 73, 74], [80, 81], [90, 91, 92, 93]]
    prompts = [head + tail for tail in own] + [head + own[1]]  # one asked twice
    assert decoding.shared_prefix(list(dict.fromkeys(map(tuple, prompts)))) == 40
    calls = []
    forward_with = decoding._forward_with

    def counted(model, cache):
        step = forward_with(model, cache)
        return lambda ids, mask, positions: calls.append(ids.shape) or step(ids, mask, positions)

    width, reference = _generate_greedily(engine.model, prompts, 8)
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=8)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(decoding, "_forward_with", counted)
        out = engine.generate(prompts, greedy, stop_ids=[119], seeds=[0] * len(prompts))
    assert calls[:2] == [torch.Size([1, 40]), torch.Size([5, 5])]  # the shared head, then each prompt's own
    logprobs = torch.stack([torch.log_softmax(step.float(), dim=-1) for step in reference.logits], dim=1)
    for row, generation in enumerate(out):
        tokens = reference.sequences[row, width:]
        stop = (tokens == 119).nonzero()
        end = stop[0].item() + 1 if len(stop) else 8
        assert generation.response_ids == tokens[:end].tolist()
        expected = logprobs[row, :end].gather(-1, tokens[:end, None])[:, 0]
        assert torch.allclose(torch.tensor(generation.logprobs), expected, atol=1e-4)


def test_a_prompt_asked_several_times_samples_each_request_as_if_alone(policy):
    """A prompt prefilled once for its copies: each copy still samples from its own seed,
    as it would alone in a batch."""
    engine = _engine(policy)
    prompts = [PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[0]]
    seeds = request_seeds(5, 0, 4)
    together = engine.generate(prompts, SAMPLING, stop_ids=[0], seeds=seeds)
    alone = [engine.generate([p], SAMPLING, stop_ids=[0], seeds=[s])[0] for p, s in zip(prompts, seeds, strict=True)]
    assert [g.response_ids for g in together] == [g.response_ids for g in alone]
    assert len({tuple(g.response_ids) for g in together[:2]}) == 2  # copies do not share a sample


def test_rows_leaving_the_cache_move_the_last_rows_into_their_places(policy):
    """``drop_rows``: the kept rows' keys and values are what they were, in the order it
    returns, each kept row among the first ones staying where it was."""
    from drmas.generation.engines.decode import _forward_with, drop_rows, left_pad, reserved_cache

    model = _engine(policy).model
    prompts = [[5, 6, 7], [9, 10, 11], [12, 13, 14], [15, 16, 17], [18, 19, 20], [21, 22, 23]]
    ids, mask = left_pad(prompts, 0, torch.device("cpu"))
    cache = reserved_cache(model, 10)
    _forward_with(model, cache)(ids, mask, (mask.cumsum(-1) - 1).clamp(min=0))
    before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    order = drop_rows(cache, [0, 2, 4, 5])
    assert order == [0, 4, 2, 5]
    for layer, (keys, values) in zip(cache.layers, before, strict=True):
        assert torch.equal(layer.keys, keys[order]) and torch.equal(layer.values, values[order])
    # The cache goes on: the next step writes into the kept rows' room.
    step = torch.tensor([[30], [31], [32], [33]])
    _forward_with(model, cache)(step, torch.ones(4, 4, dtype=torch.long), torch.full((4, 1), 3))
    assert cache.get_seq_length() == 4 and cache.layers[0].keys.shape[0] == 4
