"""What every rollout engine shares: the ``Engine`` protocol a worker group generates
through, a ``Generation`` result, and the per-request seeds. The engines (``hf``, ``sglang``)
import it; ``drmas.generation.engines`` picks one (``make_engine``)."""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from drmas.config import SamplingConfig

if TYPE_CHECKING:
    import torch

__all__ = ["Engine", "Generation", "request_seeds"]


@dataclass(frozen=True)
class Generation:
    """One response: its tokens (the end-of-turn token included when it stopped)."""

    response_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    """'stop' (the model ended its turn) or 'length' (max_new_tokens reached)."""


class Engine(Protocol):
    """What a worker group needs from an inference engine."""

    resident: bool
    """Whether the weights currently occupy device memory."""

    def load(self, policy_dir: Path) -> None:
        """Load (or replace) the weights from a folder in HF layout."""

    def generate(
        self, prompts: list[list[int]], sampling: SamplingConfig, stop_ids: list[int], seeds: list[int]
    ) -> list[Generation]:
        """One batched generate over all prompts, ``seeds[i]`` seeding request i (see
        ``request_seeds``); deterministic for given seeds."""

    def set_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Generate from these weights (HF parameter names, whole tensors) from now on, also
        after an offload: an update's new policy, handed over in memory."""

    def offload(self) -> None:
        """Release the weights' (and cache's) memory; ``resume`` brings them back."""

    def resume(self) -> None:
        """Make the last loaded weights resident again."""


def request_seeds(seed: int, first: int, count: int) -> list[int]:
    """The sampling seeds of requests ``first .. first+count-1`` of a generate call seeded
    ``seed``: each request has its own, so a request's sample does not depend on which
    engine of a data-parallel group serves it (where the engine honours per-request seeds)."""
    return [zlib.crc32(f"{seed}/{index}".encode()) & 0x7FFFFFFF for index in range(first, first + count)]
