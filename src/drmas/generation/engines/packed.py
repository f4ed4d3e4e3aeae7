"""A model's linear layers through oneDNN with their weights packed once, for decoding on a
CPU: what inductor's CPU freezing and Intel's extension for PyTorch do for inference.

``torch.nn.functional.linear`` hands the weight to the matmul kernel in PyTorch's layout,
which the kernel repacks into its own at every call. At a decode step's batch (tens of
rows) that repacking is a large part of the call: measured on SmolLM2-135M's shapes, one
thread, 32 rows, an MLP projection 0.55 -> 0.45 ms and the output embedding (576 x 49152)
30 -> 20 ms with the weight packed ahead (``torch.ops.mkldnn._reorder_linear_weight``,
then ``torch.ops.mkldnn._linear_pointwise``, any number of rows).

The packed weights are a second copy, made for the linears a decode uses and kept until
``release`` (the engine releases them when it lets go of its memory); a weight is packed
again when it has changed since: new storage (a move, a new policy) or a new version
(``load_state_dict`` copies into it in place, which bumps its version counter).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial

import torch

__all__ = ["PackedLinears"]

_PACKED_DTYPES = (torch.float32, torch.bfloat16)


class PackedLinears:
    """The packed copies of one model's linear weights; ``installed`` runs the model's
    linears through them."""

    def __init__(self) -> None:
        self._packed: dict[torch.nn.Linear, tuple[int, int, torch.Tensor]] = {}
        """Per linear: the storage and version of the weight it was packed from, and the
        packed copy."""

    @contextmanager
    def installed(self, model: torch.nn.Module) -> Iterator[None]:
        """Within it, every linear of ``model`` that oneDNN can run (a CPU weight in float32,
        or bfloat16 where the CPU computes it natively) multiplies by its packed weight;
        the model is as it was afterwards."""
        linears = [module for module in model.modules() if type(module) is torch.nn.Linear and _packable(module)]
        try:
            for linear in linears:
                linear.forward = partial(_packed_linear, self._packed_weight(linear), linear.bias)  # type: ignore[method-assign]
            yield
        finally:
            for linear in linears:
                linear.__dict__.pop("forward", None)

    def __len__(self) -> int:
        """How many linears hold a packed copy."""
        return len(self._packed)

    def release(self) -> None:
        """Drop every packed copy (the next ``installed`` packs again)."""
        self._packed.clear()

    def _packed_weight(self, linear: torch.nn.Linear) -> torch.Tensor:
        weight = linear.weight
        key = (weight.data_ptr(), weight._version)
        held = self._packed.get(linear)
        if held is None or held[:2] != key:
            self._packed.pop(linear, None)  # its memory goes before the new copy is made
            with torch.no_grad():
                packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
            self._packed[linear] = (*key, packed)
            return packed
        return held[2]


def _packable(linear: torch.nn.Linear) -> bool:
    weight = linear.weight
    if weight.device.type != "cpu" or weight.dtype not in _PACKED_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    return weight.dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _packed_linear(weight: torch.Tensor, bias: torch.Tensor | None, inputs: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(inputs, weight, bias, "none", [], "")
