"""The weight-safety policy: drmas loads weights only from safetensors, never a pickle,
and says why it refuses a model folder. Torch-free and drmas-free, so that the config
(which checks a local model folder when it loads) and the stages that only check policies
(checkpoint) need not import torch."""

from __future__ import annotations

import typing
from pathlib import Path

__all__ = ["PICKLED_WEIGHTS", "SAFE_WEIGHTS", "PolicyError", "local_model_problem", "weights_problem"]


SAFE_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")
"""The weight files drmas loads: one safetensors file, or the index of sharded ones."""


PICKLED_WEIGHTS = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
"""Suffixes of pickled weights (``pytorch_model.bin``, ``*.pt``): loading one runs code."""


class PolicyError(ValueError):
    """A policy (model folder or artifact) that drmas will not load; the message says where
    it is and why. Defined beside the folder checks, so that stages that only check policies
    (checkpoint) need not import torch."""


def weights_problem(names: typing.Iterable[str]) -> str | None:
    """Why drmas will not load the weights of a model folder holding these files, or None.

    Weights load only from safetensors: a pickle runs whatever code it holds when it is
    loaded, so a folder with only pickled weights is refused, never opened or converted.
    """
    names = sorted(names)
    if any(name in SAFE_WEIGHTS for name in names):
        return None
    pickled = [name for name in names if name.endswith(PICKLED_WEIGHTS)]
    if pickled:
        return (
            f"has pickled weights ({', '.join(pickled)}) and no model.safetensors; drmas loads "
            "weights only from safetensors (a pickle runs code when it is loaded)"
        )
    return "has no model.safetensors (no weights)"


def local_model_problem(folder: Path) -> str | None:
    """Why a local model folder cannot be a drmas policy, or None; checked at config time so
    that a wrong path fails before anything runs."""
    if not folder.is_dir():
        return "looks like a local folder but does not exist"
    names = [path.name for path in folder.iterdir()]
    if "config.json" not in names:
        return "has no config.json (not a Hugging Face model folder)"
    return weights_problem(names)
