"""Training engines: what steps one worker group's optimizer, behind one protocol.

The update's loop (``drmas.training.loop``) sees only ``TrainEngine``; ``make_engine`` picks
the engine ``train.backend`` names.

    base       the TrainEngine protocol, rank and device, the AdamW both engines step
    torch      plain torch AdamW, gradients summed across data-parallel ranks
    deepspeed  the same AdamW in DeepSpeed ZeRO 0-3, and DeepSpeed's config
"""

from __future__ import annotations

from torch import nn

from drmas.config import DrmasConfig, WorkerGroup
from drmas.training.engines.base import (
    ALONE_WAIT_S,
    TrainEngine,
    full_shape,
    rank_and_world,
    training_device,
    wait_for_all,
)
from drmas.training.engines.deepspeed import DeepSpeedEngine, zero3_load_config
from drmas.training.engines.torch import TorchEngine

__all__ = [
    "ALONE_WAIT_S",
    "TrainEngine",
    "full_shape",
    "make_engine",
    "rank_and_world",
    "training_device",
    "wait_for_all",
    "zero3_load_config",
]


def make_engine(model: nn.Module, group: WorkerGroup, config: DrmasConfig) -> TrainEngine:
    """The engine ``train.backend`` names, stepping ``group``'s optimizer over ``model``."""
    if config.train.backend == "deepspeed":
        return DeepSpeedEngine(model, group, config)
    return TorchEngine(model, group, config)
