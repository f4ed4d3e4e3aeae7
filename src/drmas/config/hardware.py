"""What this machine's processor computes natively, for the config fields that choose by it
(``models.*.dtype: auto``). Below every other layer: the config resolves with it."""

from __future__ import annotations

__all__ = ["native_bf16"]


def native_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX-512 or AMX, as oneDNN requires). Without
    it torch emulates bf16: a SmolLM2-sized matmul and its backward took 12.6x float32's
    time on an AVX2-only EPYC, where with AMX bf16 is 1.4-1.6x faster than float32."""
    import torch  # noqa: PLC0415 - only asked when a bf16 group would train here

    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
