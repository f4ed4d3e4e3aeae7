"""The transformers engine: batched, left-padded, KV-cached sampling on CPU (or one GPU)."""

from __future__ import annotations

import gc
from pathlib import Path

import torch

from drmas.config import SamplingConfig
from drmas.generation.engines import Generation
from drmas.models import load_model


class HFEngine:
    """Generates with ``model.generate``; offload drops the weights, resume reloads them.

    Reloading from the local safetensors file is cheap for the models that run on CPU, and
    it frees the memory for real, which is the point of offloading in a shared pool.
    """

    def __init__(self, dtype: str = "float32") -> None:
        self.dtype = dtype
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.policy_dir: Path | None = None
        self.model = None

    @property
    def resident(self) -> bool:
        return self.model is not None

    def load(self, policy_dir: Path) -> None:
        self.policy_dir = Path(policy_dir)
        self.model = None  # not offload(): its gc.collect() costs ~0.1 s a call on CPU
        self.resume()

    def offload(self) -> None:
        self.model = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def resume(self) -> None:
        if self.model is None:
            if self.policy_dir is None:
                raise RuntimeError("resume() before load(): no policy to make resident")
            self.model = load_model(self.policy_dir, self.dtype).to(self.device)

    @torch.no_grad()
    def generate(
        self, prompts: list[list[int]], sampling: SamplingConfig, stop_ids: list[int], seed: int
    ) -> list[Generation]:
        if not prompts:
            return []
        self.resume()
        pad_id = self.model.config.pad_token_id if self.model.config.pad_token_id is not None else stop_ids[0]
        input_ids, attention_mask = _left_pad(prompts, pad_id, self.device)  # [B, P]
        greedy = sampling.temperature == 0
        torch.manual_seed(seed)
        output = self.model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            do_sample=not greedy,
            temperature=None if greedy else sampling.temperature,
            top_p=None if greedy else sampling.top_p,
            top_k=None if greedy or sampling.top_k == 0 else sampling.top_k,
            max_new_tokens=sampling.max_new_tokens,
            eos_token_id=stop_ids,
            pad_token_id=pad_id,
            output_logits=True,
            return_dict_in_generate=True,
        )
        new_tokens = output.sequences[:, input_ids.shape[1] :]  # [B, T]
        logprobs = _sampled_logprobs(output.logits, new_tokens, sampling.temperature)  # [B, T]
        return [_cut(new_tokens[b], logprobs[b], set(stop_ids)) for b in range(len(prompts))]


def _left_pad(prompts: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        mask[row, width - len(prompt) :] = 1
    return ids.to(device), mask.to(device)


def _sampled_logprobs(step_logits: tuple[torch.Tensor, ...], tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """log p(token) under the sampling distribution's temperature, step by step ([B, V] each)."""
    scale = temperature if temperature > 0 else 1.0
    columns = [
        torch.log_softmax(logits.float() / scale, dim=-1).gather(-1, tokens[:, t : t + 1])
        for t, logits in enumerate(step_logits)
    ]
    return torch.cat(columns, dim=-1)  # [B, T]


def _cut(tokens: torch.Tensor, logprobs: torch.Tensor, stop_ids: set[int]) -> Generation:
    """Keep the tokens up to and including the first stop token."""
    ids = tokens.tolist()
    end = next((i + 1 for i, token in enumerate(ids) if token in stop_ids), None)
    length = end if end is not None else len(ids)
    return Generation(ids[:length], logprobs[:length].tolist(), "stop" if end is not None else "length")
