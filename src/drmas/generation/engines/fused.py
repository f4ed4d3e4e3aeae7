"""A decode step for Llama-shaped decoders in fewer ops than the model's own forward.

On a CPU part of a rollout's decode step is per-op overhead (issue 30: a 32-row
SmolLM2-135M step of 109 ms on an AMX Xeon spent 71 ms in matmuls; the model's other ~40 ops
a layer, the mask and rotary set-up and transformers' module plumbing took the rest). As
inference engines do with their own model code (SGLang's and vLLM's ``LlamaForCausalLM``
with ``QKVParallelLinear`` and ``MergedColumnParallelLinear``), one step here:

- projects q, k and v with one matmul and gate and up with another, over weights laid out
  side by side in one tensor, the model's own ``q_proj.weight`` etc. becoming views of it
  (``fuse_projections``): no second copy, and weights handed over later (``load_state_dict``
  copies into the views) land in the fused tensor;
- rotates q and k together, with cos/sin computed once a step by the model's own rotary
  module (its scaling types included) and ``rotate_half``'s sign folded into sin;
- on a CPU, multiplies by weights packed in oneDNN's blocked layout (``packed``), as
  ``torch.compile`` with inductor's ``freezing`` does for a CPU linear of varying batch
  size (``mkldnn._linear_pointwise`` over ``mkldnn._reorder_linear_weight``): 1.3-2x
  faster than MKL's plain ``sgemm`` at a decode step's 8-32 rows, the decode 1.3x faster
  (float32, 2 threads, an AVX2 EPYC). The packed copies are a second copy of the
  projections' and the output layer's weights, packed again when a weight is written;
- adds the residuals in place;
- attends the way transformers' SDPA path does at one query (the query heads of a key/value
  head as that head's queries: one SDPA call, no repeated keys), over the ``ReservedLayer``
  rooms the prefill wrote.

It computes what the model's forward computes, up to the rounding of fused arithmetic
(tests compare the logits). Models it does not know (``supports``) decode through their
forward.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["FusedDecoder", "fuse_projections", "supports"]

_ARCHITECTURES = {"llama", "qwen2", "qwen3"}
"""``model_type``s whose decoder layer is Llama's: pre-norm RMSNorm, rotary q/k, SwiGLU
MLP; Qwen2 adds biases to q/k/v, Qwen3 an RMSNorm on each q and k head."""


def supports(model: torch.nn.Module) -> bool:
    """Whether ``FusedDecoder`` computes ``model``'s decode step: a transformers model of a
    known architecture, SiLU, no MLP bias, every projection a plain ``nn.Linear`` (a LoRA
    adapter wrapping one, say, is not read here: such a model decodes through its forward).
    The caller checks that every layer's cache is a ``ReservedLayer`` (full attention, in
    reserved room)."""
    config = getattr(model, "config", None)
    layers = getattr(getattr(model, "model", None), "layers", None)
    return (
        config is not None
        and layers is not None
        and getattr(config, "model_type", None) in _ARCHITECTURES
        and config.hidden_act == "silu"
        and not getattr(config, "mlp_bias", False)
        and getattr(config, "pretraining_tp", 1) == 1
        and all(_plain(layer) for layer in layers)
    )


def _plain(layer: torch.nn.Module) -> bool:
    attention, mlp = layer.self_attn, layer.mlp
    projections = [attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj]
    return all(type(linear) is torch.nn.Linear for linear in [*projections, mlp.gate_proj, mlp.up_proj, mlp.down_proj])


_fused: weakref.WeakKeyDictionary[torch.nn.Module, torch.Tensor] = weakref.WeakKeyDictionary()


def fuse_projections(linears: list[torch.nn.Linear]) -> torch.Tensor:
    """One ``[sum(out), in]`` weight holding ``linears``' weights one after another, each
    linear's weight becoming a view of its rows. Done once: a later call on linears that
    are already views of one tensor returns it (if something replaced a weight since, such
    as ``module.to`` moving it, they are laid out again)."""
    first = linears[0]
    fused = _fused.get(first)
    if fused is not None and _views_of(fused, [linear.weight for linear in linears]):
        return fused
    with torch.no_grad():
        fused = torch.cat([linear.weight for linear in linears])
        start = 0
        for linear in linears:
            rows = linear.weight.shape[0]
            linear.weight.data = fused[start : start + rows]
            start += rows
    _fused[first] = fused  # the one laid out last: an earlier one is no longer viewed
    return fused


def _views_of(fused: torch.Tensor, weights: list[torch.Tensor]) -> bool:
    """Whether ``weights`` are ``fused``'s rows in order."""
    pointer = fused.data_ptr()
    for weight in weights:
        if weight.data_ptr() != pointer or weight.untyped_storage().data_ptr() != fused.untyped_storage().data_ptr():
            return False
        pointer += weight.numel() * weight.element_size()
    return pointer == fused.data_ptr() + fused.numel() * fused.element_size()


class _Projection:
    """A linear map of the fused step: ``weight`` (one projection's, or several side by
    side), its bias, and the parameters it is made of (``parts``: those an optimizer step
    or ``load_state_dict`` writes). Its packed weight is looked up once, when the decoder
    is built (once a ``decode`` call: the weights do not change during one), not at every
    step."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, parts: list[torch.Tensor]) -> None:
        self.weight, self.bias, self.parts = weight, bias, parts
        self.packed = packed(weight, parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return x @ self.weight.t() if self.bias is None else torch.addmm(self.bias, x, self.weight.t())


PACKED_ROWS = 32
"""The row count oneDNN packs the weights for (its blocking depends on it): the packed
weights serve any row count; 16 and 32 decoded alike, 64 8% slower (32 rows decoding, fp32,
an AVX2 EPYC)."""

_packed: WeakIdKeyDictionary = WeakIdKeyDictionary()
"""weight -> (the version counters of its parts when packed, the packed weight)."""


def packed(weight: torch.Tensor, parts: list[torch.Tensor]) -> torch.Tensor | None:
    """``weight`` in oneDNN's blocked layout for ``mkldnn._linear_pointwise``, packed once
    and again whenever one of ``parts`` has been written since (its version counter moved:
    in-place writes such as ``load_state_dict``'s copy or an optimizer's step move it;
    writes through ``.data`` do not, and are not seen). None where oneDNN does not pack
    this weight: off the CPU, or a dtype the CPU lacks kernels for (bf16 needs AVX-512 or
    AVX-NE-CONVERT)."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return None
    if weight.dtype != torch.float32 and not (
        weight.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    ):
        return None
    versions = tuple(part._version for part in parts)
    entry = _packed.get(weight)
    if entry is None or entry[0] != versions:
        entry = (versions, torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACKED_ROWS))
        _packed[weight] = entry
    return entry[1]


class _Layer:
    """One decoder layer's weights, as the fused step reads them."""

    def __init__(self, layer: torch.nn.Module) -> None:
        attention, mlp = layer.self_attn, layer.mlp
        projections = [attention.q_proj, attention.k_proj, attention.v_proj]
        biases = [projection.bias for projection in projections]
        self.qkv = _Projection(
            fuse_projections(projections),
            torch.cat(biases) if all(bias is not None for bias in biases) else None,
            [projection.weight for projection in projections],
        )
        self.q_norm = getattr(attention, "q_norm", None)
        self.k_norm = getattr(attention, "k_norm", None)
        self.out = _linear_of(attention.o_proj)
        gate_up = [mlp.gate_proj, mlp.up_proj]
        self.gate_up = _Projection(fuse_projections(gate_up), None, [linear.weight for linear in gate_up])
        self.down = _linear_of(mlp.down_proj)
        self.input_norm = layer.input_layernorm
        self.post_norm = layer.post_attention_layernorm


def _linear_of(linear: torch.nn.Linear) -> _Projection:
    return _Projection(linear.weight, linear.bias, [linear.weight])


class FusedDecoder:
    """The decode step of ``model`` (``supports`` it): token ids ``[A]`` at positions
    ``[A]`` -> next-token logits ``[A, V]``, their keys and values appended to the
    cache's rooms. It reads the weights as they are when it is built: build one after
    they change."""

    def __init__(self, model: torch.nn.Module) -> None:
        config = model.config
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        decoder = model.model
        self.embed = decoder.embed_tokens
        self.rotary = decoder.rotary_emb
        self.final_norm = decoder.norm
        self.lm_head = _linear_of(model.get_output_embeddings())
        self.layers = [_Layer(layer) for layer in decoder.layers]
        half = self.head_dim // 2
        self.sign = torch.cat([-torch.ones(half), torch.ones(half)]).to(self.embed.weight)

    def step(
        self, tokens: torch.Tensor, positions: torch.Tensor, attention_mask: torch.Tensor, cache: object
    ) -> torch.Tensor:
        """``attention_mask`` ``[A, L+1]`` covers the cached positions and this one."""
        rows = tokens.shape[0]
        hidden = self.embed(tokens)
        cos, sin = self.rotary(hidden, positions[:, None])  # [A, 1, D]
        sin = sin * self.sign
        masked = (attention_mask == 0)[:, None, None, :]  # [A, 1, 1, L+1]
        allowed = ~masked if bool(masked.any()) else None
        rotated = self.heads + self.kv_heads
        groups = self.heads // self.kv_heads
        for weights, layer in zip(self.layers, cache.layers, strict=True):
            x = _norm(weights.input_norm, hidden)
            qkv = weights.qkv(x).view(rows, rotated + self.kv_heads, self.head_dim)
            qk, value = qkv[:, :rotated], qkv[:, rotated:]
            if weights.q_norm is not None:
                qk = torch.cat([weights.q_norm(qk[:, : self.heads]), weights.k_norm(qk[:, self.heads :])], dim=1)
            qk = torch.addcmul(qk * cos, qk.roll(self.head_dim // 2, dims=-1), sin)
            query, key = qk[:, : self.heads], qk[:, self.heads :]
            keys, values = layer.update(key[:, :, None], value[:, :, None])
            attended = F.scaled_dot_product_attention(
                query.reshape(rows, self.kv_heads, groups, self.head_dim), keys, values, attn_mask=allowed
            )
            hidden.add_(weights.out(attended.reshape(rows, -1)))
            gate, up = weights.gate_up(_norm(weights.post_norm, hidden)).chunk(2, dim=-1)
            hidden.add_(weights.down(F.silu(gate) * up))
        return self.lm_head(_norm(self.final_norm, hidden))


def _norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The model's RMSNorm in one op where that is the same arithmetic: float32 (the model
    rounds to its dtype before the weight multiplies, so other dtypes go through it)."""
    if x.dtype != torch.float32:
        return norm(x)
    return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)
