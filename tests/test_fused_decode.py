"""The engine's fused decode step (``FusedDecoder``) against the model's own forward, on real
transformers models of each architecture it knows (tiny, built from a config, random
weights: norms and biases randomised so that each weight matters)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from drmas.config import SamplingConfig
from drmas.generation.engines import decode as decoding
from drmas.generation.engines import fused
from drmas.generation.engines.fused import FusedDecoder, fuse_projections, supports
from drmas.generation.engines.hf import HFEngine

SHAPE = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=256,
    max_position_embeddings=256,
    pad_token_id=0,
    tie_word_embeddings=True,
)
ARCHITECTURES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {}),
    "llama-untied-biased": (LlamaConfig, LlamaForCausalLM, {"tie_word_embeddings": False, "attention_bias": True}),
}
PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14], [15, 16, 17, 18]]


def tiny(architecture: str) -> torch.nn.Module:
    config_class, model_class, extra = ARCHITECTURES[architecture]
    torch.manual_seed(0)
    model = model_class(config_class(**{**SHAPE, **extra})).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                parameter.copy_(
                    1.0 + 0.3 * torch.randn_like(parameter) if "norm" in name else torch.randn_like(parameter)
                )
    return model


def _prefilled(model: torch.nn.Module) -> tuple[object, torch.Tensor, torch.Tensor]:
    """A reserved cache holding ``PROMPTS`` (left-padded), its mask and next positions."""
    ids, mask = decoding.left_pad(PROMPTS, 0, torch.device("cpu"))
    cache = decoding.reserved_cache(model, 16)
    decoding._forward_with(model, cache)(ids, mask, decoding._positions(mask))
    return cache, mask, mask.sum(dim=-1)


@pytest.mark.parametrize("architecture", list(ARCHITECTURES))
def test_the_fused_step_computes_what_the_models_forward_does(architecture):
    """Three decode steps over left-padded rows: the same logits (float32 rounding) and the
    same keys and values appended to the cache."""
    model = tiny(architecture)
    assert supports(model)
    theirs, mask, positions = _prefilled(model)
    ours, _, _ = _prefilled(model)
    forward, fused = decoding._forward_with(model, theirs), FusedDecoder(model)
    tokens = torch.tensor([20, 21, 22, 23])
    with torch.no_grad():
        for _ in range(3):
            mask = torch.cat([mask, torch.ones(4, 1, dtype=mask.dtype)], dim=-1)
            expected = forward(tokens[:, None], mask, positions[:, None])
            logits = fused.step(tokens, positions, mask, ours)
            assert torch.allclose(logits, expected, atol=1e-5), (logits - expected).abs().max()
            tokens, positions = expected.argmax(dim=-1), positions + 1
    for mine, reference in zip(ours.layers, theirs.layers, strict=True):
        assert torch.allclose(mine.keys, reference.keys, atol=1e-5)
        assert torch.allclose(mine.values, reference.values, atol=1e-5)


def test_decode_samples_alike_through_the_fused_step_and_the_models_forward():
    """Sampling with rows ending apart (a frequent token as the stop) and prompts asked
    twice: the same responses, log-probs within float32 rounding."""
    model = tiny("llama")
    prompts = [*PROMPTS, PROMPTS[0], PROMPTS[2]]
    sampling = SamplingConfig(temperature=1.0, top_p=0.9, max_new_tokens=10)
    free = decoding.decode(model, prompts, sampling, [-1], list(range(6)))
    counts = Counter(token for generation in free for token in generation.response_ids[:-1])
    stop = counts.most_common(1)[0][0]
    runs = [decoding.decode(model, prompts, sampling, [stop], list(range(6)), fused=fused) for fused in (False, True)]
    assert [g.response_ids for g in runs[0]] == [g.response_ids for g in runs[1]]
    assert len({len(g.response_ids) for g in runs[1]}) > 1  # rows left the batch apart
    for theirs, ours in zip(*runs, strict=True):
        assert torch.allclose(torch.tensor(ours.logprobs), torch.tensor(theirs.logprobs), atol=1e-5)


def test_the_fused_step_is_taken_only_where_it_knows_the_model(monkeypatch):
    """A model outside what ``supports`` covers (here a GELU MLP) decodes through its own
    forward, and alike."""
    steps = []
    monkeypatch.setattr(FusedDecoder, "step", lambda self, *args: steps.append(1) or None)
    config_class, model_class, _ = ARCHITECTURES["llama"]
    torch.manual_seed(0)
    model = model_class(config_class(**SHAPE, hidden_act="gelu")).eval()
    assert not supports(model)
    out = decoding.decode(model, PROMPTS, SamplingConfig(temperature=0.0, max_new_tokens=4), [255], [0] * 4)
    assert steps == [] and all(len(g.response_ids) == 4 for g in out)


def test_weights_handed_over_land_in_the_fused_projections(tmp_path):
    """The engine's q/k/v and gate/up weights become views of one tensor each; weights set
    later (``set_weights``, as after each update) are what the fused step then uses."""
    model = tiny("qwen3")
    model.save_pretrained(tmp_path)
    engine = HFEngine("float32")
    engine.load(tmp_path)
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=6)
    before = engine.generate(PROMPTS, greedy, [255], [0] * 4)
    attention = engine.model.model.layers[0].self_attn
    fused = fuse_projections([attention.q_proj, attention.k_proj, attention.v_proj])
    assert attention.k_proj.weight.data_ptr() == fused[attention.q_proj.weight.shape[0] :].data_ptr()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.5 * torch.randn_like(parameter))
    engine.set_weights(model.state_dict())
    assert torch.equal(fused[: attention.q_proj.weight.shape[0]], model.model.layers[0].self_attn.q_proj.weight)
    after = engine.generate(PROMPTS, greedy, [255], [0] * 4)
    engine.fused_step = False
    assert [g.response_ids for g in after] == [g.response_ids for g in engine.generate(PROMPTS, greedy, [255], [0] * 4)]
    assert [g.response_ids for g in after] != [g.response_ids for g in before]


def test_weights_replaced_since_are_laid_out_again():
    """A weight replaced after fusing (``module.to`` moving it, say) is no longer a view:
    the next ``FusedDecoder`` lays the projections out again and computes with it."""
    model = tiny("llama")
    FusedDecoder(model)
    attention = model.model.layers[1].self_attn
    with torch.no_grad():
        attention.v_proj.weight.data = attention.v_proj.weight.data.clone() * 2
    logits, expected = _one_step(model)
    assert torch.allclose(logits, expected, atol=1e-5)


def test_weights_an_optimizer_wrote_are_packed_again():
    """On a CPU the step multiplies by weights packed once in oneDNN's layout; after an
    optimizer step (in place, as a trainer sharing the model would take it) the next decode
    step packs them again and computes with the new weights, not the packed old ones."""
    model = tiny("qwen2")
    _one_step(model)
    q_proj = model.model.layers[0].self_attn.q_proj
    qkv = FusedDecoder(model).layers[0].qkv
    first = fused.packed(qkv.weight, qkv.parts)
    assert first is not None and fused.packed(qkv.weight, qkv.parts) is first  # packed once
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model(input_ids=torch.tensor([PROMPTS[0]]), labels=torch.tensor([PROMPTS[0]])).loss.backward()
    optimizer.step()
    assert q_proj.weight.grad.abs().sum() > 0
    logits, expected = _one_step(model)
    assert fused.packed(qkv.weight, qkv.parts) is not first
    assert torch.allclose(logits, expected, atol=1e-5), (logits - expected).abs().max()


def test_a_bfloat16_model_steps_as_its_forward_does():
    """bfloat16 weights: packed where the CPU has oneDNN's bf16 kernels (AVX-512 or
    AVX-NE-CONVERT), multiplied plainly where it does not; the logits those of the forward
    within bf16 rounding either way."""
    model = tiny("llama").to(torch.bfloat16)
    logits, expected = _one_step(model)
    assert logits.dtype == torch.bfloat16
    assert torch.allclose(logits.float(), expected.float(), atol=0.1, rtol=0.02), (logits - expected).abs().max()


def _one_step(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step after ``PROMPTS``: the fused step's logits and the forward's."""
    cache, mask, positions = _prefilled(model)
    reference, _, _ = _prefilled(model)
    mask = torch.cat([mask, torch.ones(4, 1, dtype=mask.dtype)], dim=-1)
    tokens = torch.tensor([30, 31, 32, 33])
    with torch.no_grad():
        expected = decoding._forward_with(model, reference)(tokens[:, None], mask, positions[:, None])
        return FusedDecoder(model).step(tokens, positions, mask, cache), expected


@pytest.mark.parametrize(("rows", "vocab", "count"), [(5, 4096, 16), (3, 49152, 64), (4, 1000, 8), (2, 512, 64)])
def test_top_candidates_are_topk(rows, vocab, count):
    """The chunked search finds what ``topk`` finds (the values, largest first, and the ids
    holding them), ties included; vocabularies it cannot chunk go through ``topk``."""
    generator = torch.Generator().manual_seed(vocab)
    scores = torch.randn(rows, vocab, generator=generator) * 3
    scores[0, 100:140] = scores[0].max() + 1  # a tie across the cut
    top, ids = decoding.top_candidates(scores, count)
    expected = scores.topk(count, dim=-1)
    assert torch.equal(top, expected.values)
    assert torch.equal(scores.gather(-1, ids), top)
