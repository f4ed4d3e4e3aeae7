"""The transformers engine: batched, left-padded, KV-cached sampling on CPU (or one GPU),
through drmas's decode loop (``decode``: each distinct prompt prefilled once, ended rows
leaving the batch)."""

from __future__ import annotations

import gc
from pathlib import Path

import torch

from drmas.config import SamplingConfig
from drmas.generation.engines.base import Generation
from drmas.generation.engines.decode import decode
from drmas.models import load_model


class HFEngine:
    """Generates with ``decode`` (a lean ``model.generate``); offload drops the weights, resume reloads them.

    Reloading from the local safetensors file is cheap for the models that run on CPU, and
    it frees the memory for real, which is the point of offloading in a shared pool. An
    update's weights handed over in memory (``set_weights``) are kept on the host and
    resumed from.

    Each request samples from its own random stream (its seed), so a response does not
    depend on its batch-mates: the same requests split over any number of engines sample
    alike (up to the last bits of batched arithmetic).
    """

    def __init__(self, dtype: str = "float32") -> None:
        self.dtype = dtype
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.policy_dir: Path | None = None
        self.weights: dict[str, torch.Tensor] | None = None
        self.model = None

    @property
    def resident(self) -> bool:
        return self.model is not None

    def load(self, policy_dir: Path) -> None:
        self.policy_dir = Path(policy_dir)
        self.weights = None
        self.model = None  # not offload(): its gc.collect() costs ~0.1 s a call on CPU
        self.resume()

    def set_weights(self, weights: dict[str, torch.Tensor]) -> None:
        if self.policy_dir is None:
            raise RuntimeError("set_weights() before load(): no model to put the weights into")
        self.weights = {name: tensor.detach().to("cpu", copy=True) for name, tensor in weights.items()}
        if self.model is not None:
            load_weights(self.model, self.weights)

    def offload(self) -> None:
        self.model = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def resume(self) -> None:
        if self.model is None:
            if self.policy_dir is None:
                raise RuntimeError("resume() before load(): no policy to make resident")
            model = load_model(self.policy_dir, self.dtype)
            if self.weights is not None:
                load_weights(model, self.weights)
            self.model = model.to(self.device)

    @torch.no_grad()
    def generate(
        self, prompts: list[list[int]], sampling: SamplingConfig, stop_ids: list[int], seeds: list[int]
    ) -> list[Generation]:
        if not prompts:
            return []
        self.resume()
        return decode(self.model, prompts, sampling, stop_ids, seeds)


def load_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Copy ``weights`` into ``model``; a name the model lacks, or one of its weights left
    out (other than one tied to a given weight, such as a tied output embedding), raises."""
    result = model.load_state_dict(weights, strict=False)
    state = model.state_dict()
    given = {state[name].data_ptr() for name in weights if name in state}
    untouched = [name for name in result.missing_keys if state[name].data_ptr() not in given]
    if result.unexpected_keys or untouched:
        raise ValueError(
            f"weights do not fit the model: unknown {sorted(result.unexpected_keys)[:5]}, "
            f"missing {sorted(untouched)[:5]}"
        )
