"""``PackedLinears``: a model's linears through oneDNN with weights packed once (the CPU
decode path of the transformers engine), on a real tiny transformers model."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from drmas.generation.engines.packed import PackedLinears

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")


@pytest.fixture
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config).eval()


def _linears(model: torch.nn.Module) -> list[torch.nn.Linear]:
    return [module for module in model.modules() if type(module) is torch.nn.Linear]


@torch.no_grad()
def test_the_linears_run_on_packed_weights_within_and_as_before_after(model):
    ids = torch.randint(0, 96, (3, 7))
    plain = model(ids).logits
    packed = PackedLinears()
    with packed.installed(model):
        assert all("forward" in linear.__dict__ for linear in _linears(model))
        within = model(ids).logits
    assert len(packed) == len(_linears(model)) == 2 * 7 + 1  # q k v o gate up down per layer, the head
    assert not any("forward" in linear.__dict__ for linear in _linears(model))
    assert torch.allclose(within, plain, atol=1e-5)
    assert torch.equal(model(ids).logits, plain)  # restored: the plain kernel again


@torch.no_grad()
def test_a_weight_copied_into_is_packed_again(model):
    ids = torch.randint(0, 96, (2, 5))
    packed = PackedLinears()
    with packed.installed(model):
        before = model(ids).logits
    state = {name: tensor + 0.3 * torch.randn_like(tensor) for name, tensor in model.state_dict().items()}
    model.load_state_dict(state)  # in place: the same storage, a new version
    expected = model(ids).logits
    with packed.installed(model):
        after = model(ids).logits
    assert not torch.allclose(after, before, atol=1e-3)
    assert torch.allclose(after, expected, atol=1e-5)


@torch.no_grad()
def test_a_weight_it_cannot_pack_runs_as_before_and_release_drops_the_copies(model):
    wide = torch.nn.Sequential(torch.nn.Linear(8, 4).double())
    x = torch.randn(3, 8, dtype=torch.float64)
    packed = PackedLinears()
    with packed.installed(wide):
        assert "forward" not in wide[0].__dict__
        assert torch.equal(wide(x), wide[0](x))
    assert len(packed) == 0
    with packed.installed(model):
        model(torch.randint(0, 96, (1, 3)))
    assert len(packed) == len(_linears(model))
    packed.release()
    assert len(packed) == 0
