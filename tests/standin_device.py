"""A second device on a CPU-only machine, for tests of where the update puts its tensors.

A GPU refuses an op that mixes a CUDA tensor with a CPU one ("Expected all tensors to be on
the same device"); a CPU has one device, so nothing is refused and a missing ``.to(device)``
goes unseen. ``StandInDevice`` plays the second device: ``torch.device("cpu", 0)``, which
computes on the CPU like ``cpu`` but is a different device object. Under it (a
``TorchFunctionMode``), a tensor is *on the device* when it came from ``.to(that device)``
(a module moved there included), from a factory given ``device=`` it, from an op with
such an input, or when its ``.data`` is set to such a tensor (as ZeRO-3 moves
parameters); ``tensor.device`` then says so. Every op that drmas code calls itself and that
mixes tensors on the device with tensors off it is recorded as a violation, as a GPU
would refuse it (a 0-dim CPU tensor may mix, as on CUDA). Ops inside torch, transformers or
DeepSpeed are not checked: their placement is theirs, and only a GPU can check it.
"""

from __future__ import annotations

import sys
import weakref
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

import drmas

STANDIN = torch.device("cpu", 0)
TORCH_DIR = str(Path(torch.__file__).parent)
DRMAS_DIR = str(Path(drmas.__file__).parent)
DEVICE_DESCRIPTOR = torch._C.TensorBase.__dict__["device"]
MOVES = {torch.Tensor.to, torch._C.TensorBase.to}
LEAVES = {torch.Tensor.cpu, torch._C.TensorBase.cpu}
ALLOWED_ACROSS = {"to", "cpu", "copy_", "__getitem__", "__setitem__", "__get__", "__set__"}
"""Ops that CUDA also allows across devices (copies, indexing with a CPU index)."""


class StandInDevice(TorchFunctionMode):
    """Tracks which tensors are on ``STANDIN`` and records the ops of drmas that mix."""

    def __init__(self) -> None:
        super().__init__()
        self._on: dict[int, weakref.ref[torch.Tensor]] = {}
        self.violations: list[str] = []

    def on_device(self, tensor: torch.Tensor) -> bool:
        ref = self._on.get(id(tensor))
        return ref is not None and ref() is tensor

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__self__", None) is DEVICE_DESCRIPTOR:  # tensor.device
            return STANDIN if self.on_device(args[0]) else func(*args, **kwargs)
        leaves = pytree.tree_leaves((args, kwargs))
        tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        moves = any(_names(leaf, STANDIN) for leaf in leaves)
        leaves_device = func in LEAVES or (func in MOVES and any(_names(leaf, torch.device("cpu")) for leaf in leaves))
        if not moves and getattr(func, "__name__", "") not in ALLOWED_ACROSS and _called_from_drmas():
            self._check(func, tensors)
        result = func(*args, **kwargs)
        if getattr(func, "__name__", "") == "__set__" and len(args) == 2 and isinstance(args[1], torch.Tensor):
            self._assigned(args[0], args[1])  # ``param.data = tensor``: the param is where its data is
        if moves or (not leaves_device and any(self.on_device(t) for t in tensors)):
            for out in pytree.tree_leaves(result):
                if isinstance(out, torch.Tensor):
                    self._on[id(out)] = weakref.ref(out)
            if moves and func in MOVES and isinstance(args[0], torch.nn.Parameter):
                self._on[id(args[0])] = weakref.ref(args[0])  # Module.to keeps the Parameter object
        return result

    def _assigned(self, tensor: Any, data: torch.Tensor) -> None:
        if not isinstance(tensor, torch.Tensor):
            return
        if self.on_device(data):
            self._on[id(tensor)] = weakref.ref(tensor)
        else:
            self._on.pop(id(tensor), None)

    def _check(self, func: Any, tensors: list[torch.Tensor]) -> None:
        on = [t for t in tensors if self.on_device(t)]
        off = [t for t in tensors if not self.on_device(t) and t.dim() > 0]
        if on and off:
            frame = _caller()
            self.violations.append(
                f"{getattr(func, '__qualname__', func)} at {frame.f_code.co_filename}:{frame.f_lineno}: "
                f"{len(on)} tensor(s) on {STANDIN}, shapes off it: {[tuple(t.shape) for t in off]}"
            )


def _names(value: Any, device: torch.device) -> bool:
    if isinstance(value, torch.device):
        return value == device
    return isinstance(value, str) and value == str(device)


def _caller():
    """The innermost frame outside torch (and outside this module)."""
    frame = sys._getframe(2)
    while frame.f_code.co_filename.startswith(TORCH_DIR) or frame.f_code.co_filename == __file__:
        frame = frame.f_back
    return frame


def _called_from_drmas() -> bool:
    return _caller().f_code.co_filename.startswith(DRMAS_DIR)
