"""The transformers engine: batched, left-padded, KV-cached sampling on CPU (or one GPU)."""

from __future__ import annotations

import gc
from pathlib import Path

import torch
from transformers.generation.logits_process import (
    LogitsProcessor,
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from drmas.config import SamplingConfig
from drmas.generation.engines.base import Generation
from drmas.models import load_model


class HFEngine:
    """Generates with ``model.generate``; offload drops the weights, resume reloads them.

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
        pad_id = self.model.config.pad_token_id if self.model.config.pad_token_id is not None else stop_ids[0]
        input_ids, attention_mask = _left_pad(prompts, pad_id, self.device)  # [B, P]
        greedy = sampling.temperature == 0
        sampler = [] if greedy else [SeededSampler(sampling, seeds, self.device)]
        output = self.model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            do_sample=False,  # the sampler has drawn each row's token; the greedy step takes it
            temperature=None,
            top_p=None,
            top_k=None,
            logits_processor=LogitsProcessorList(sampler),
            max_new_tokens=sampling.max_new_tokens,
            eos_token_id=stop_ids,
            pad_token_id=pad_id,
            output_logits=True,
            return_dict_in_generate=True,
        )
        new_tokens = output.sequences[:, input_ids.shape[1] :]  # [B, T]
        logprobs = _sampled_logprobs(output.logits, new_tokens, sampling.temperature)  # [B, T]
        return [_cut(new_tokens[b], logprobs[b], set(stop_ids)) for b in range(len(prompts))]


class SeededSampler(LogitsProcessor):
    """Draws each row's next token from its own generator (its request's seed), from the
    distribution ``model.generate`` would sample (temperature, then top-k, then top-p, as
    transformers orders its warpers), and leaves only that token for the greedy step."""

    def __init__(self, sampling: SamplingConfig, seeds: list[int], device: torch.device) -> None:
        self.warpers: list[LogitsProcessor] = [TemperatureLogitsWarper(sampling.temperature)]
        if sampling.top_k:
            self.warpers.append(TopKLogitsWarper(sampling.top_k))
        if sampling.top_p < 1.0:
            self.warpers.append(TopPLogitsWarper(sampling.top_p))
        self.generators = [torch.Generator(device=device).manual_seed(seed) for seed in seeds]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        for warper in self.warpers:
            scores = warper(input_ids, scores)
        probs = torch.softmax(scores.float(), dim=-1)  # [B, V]
        tokens = torch.cat([torch.multinomial(probs[b], 1, generator=g) for b, g in enumerate(self.generators)])
        chosen = torch.full_like(scores, float("-inf"))
        return chosen.scatter_(1, tokens.unsqueeze(1), 0.0)


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
