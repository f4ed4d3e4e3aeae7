"""The transformers engine: batched, left-padded, KV-cached sampling on CPU (or one GPU),
through drmas's decode loop (``decode``: each distinct prompt prefilled once, ended rows
leaving the batch)."""

from __future__ import annotations

from pathlib import Path

import torch

from drmas.config import SamplingConfig
from drmas.generation.engines.base import Generation
from drmas.generation.engines.decode import decode
from drmas.models import load_model


class HFEngine:
    """Generates with ``decode`` (a lean ``model.generate``); offload moves the model to
    host memory, resume brings it back.

    On a CPU the model already lives in host memory: offload and resume move nothing (they
    used to drop the model and read it again from its safetensors file at every resume:
    a fixed cost of every rollout, ~1 s for a 135M model, for no memory saved, since the
    handed-over weights were kept beside it). An update's weights handed over in memory
    (``set_weights``) are copied into the model, wherever it is, so the engine holds one
    copy of its weights, and on a CPU the fused decode step's packed copy of the linear
    layers' (``fused.packed``: 1.3x faster decoding; packed again after each hand-over).

    Each request samples from its own random stream (its seed), so a response does not
    depend on its batch-mates: the same requests split over any number of engines sample
    alike (up to the last bits of batched arithmetic).
    """

    MAX_ROWS = 256
    """Requests decoded together at most. A call's KV room is reserved for all its rows at
    once (~23 KB a position a row for SmolLM2-135M in bf16, 46 KB in fp32), so a large call
    goes in chunks: an evaluation of 128 questions x 16 answers (the reference's avg@16)
    would reserve 10 GB at once. Measured on SmolLM2-135M, 256 requests of the word-problem
    Solver (fp32, 2 threads): in chunks of 64 rows 294 tokens/s and +0.9 GB at the peak,
    128: 344 tokens/s, +1.4 GB; all 256 at once: 372 tokens/s, +2.7 GB (a CPU decode step
    still gains from more rows up to a few hundred)."""

    def __init__(self, dtype: str = "float32", fused_step: bool = True) -> None:
        self.dtype = dtype
        self.fused_step = fused_step
        """Decode steps through ``FusedDecoder`` where it knows the model (``decode``)."""
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.model: torch.nn.Module | None = None
        self.on_device = False

    @property
    def resident(self) -> bool:
        return self.model is not None and self.on_device

    def load(self, policy_dir: Path) -> None:
        self.model = None  # the previous policy's memory goes before the next one is read
        self.model = load_model(Path(policy_dir), self.dtype).to(self.device)
        self.on_device = True

    def set_weights(self, weights: dict[str, torch.Tensor]) -> None:
        if self.model is None:
            raise RuntimeError("set_weights() before load(): no model to put the weights into")
        load_weights(self.model, weights)  # load_state_dict copies without autograd

    def offload(self) -> None:
        if self.model is not None and self.device.type != "cpu":
            self.model.to("cpu")
            torch.cuda.empty_cache()
        self.on_device = False

    def resume(self) -> None:
        if self.model is None:
            raise RuntimeError("resume() before load(): no policy to make resident")
        if not self.on_device:
            self.model.to(self.device)
            self.on_device = True

    @torch.no_grad()
    def generate(
        self, prompts: list[list[int]], sampling: SamplingConfig, stop_ids: list[int], seeds: list[int]
    ) -> list[Generation]:
        if not prompts:
            return []
        self.resume()
        chunks = range(0, len(prompts), self.MAX_ROWS)
        return [
            generation
            for start in chunks
            for generation in decode(
                self.model,
                prompts[start : start + self.MAX_ROWS],
                sampling,
                stop_ids,
                seeds[start : start + self.MAX_ROWS],
                fused=self.fused_step,
            )
        ]


def load_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Copy ``weights`` into ``model``. A name the model lacks, or one of its weights left
    out (other than one tied to a given weight, such as a tied output embedding), raises
    before anything is copied: the model keeps the weights it had."""
    state = model.state_dict()
    given = {state[name].data_ptr() for name in weights if name in state}
    unknown = sorted(set(weights) - set(state))
    untouched = sorted(name for name in state if name not in weights and state[name].data_ptr() not in given)
    if unknown or untouched:
        raise ValueError(f"weights do not fit the model: unknown {unknown[:5]}, missing {untouched[:5]}")
    model.load_state_dict(weights, strict=False)
