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
    with pytest.raises(ValueError, match="missing.*model.norm.weight"):
        engine.set_weights(weights)
