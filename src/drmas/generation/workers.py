"""A worker group's rollout side: its tokenizer, its engine, and the policy version it holds.

``WorkerGroupRuntime`` runs inside a Ray actor (one per worker group) or in-process. It
turns agent prompts (text) into chat-formatted token ids with ITS OWN tokenizer and its
model's chat-template variables, so a heterogeneous team (different models, different
tokenizers, Qwen3 with thinking off beside a model without that switch) just works; an
over-long prompt is cut as ``rollout.truncation`` says. It reloads
weights only when asked for a policy version other than the one it holds: the store is
the source of truth, the actor a cache.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from drmas.config import PolicyError, SamplingConfig, StoreConfig, TemplateVariables
from drmas.generation.engines import make_engine
from drmas.infra.layout import PolicyRef
from drmas.infra.store import Store

__all__ = ["GenerationResult", "PolicyNotLoaded", "PolicyRef", "WorkerGroupRuntime", "truncate_prompt"]


@dataclass(frozen=True)
class GenerationResult:
    """One generated response with the ids it was generated from."""

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str


class PolicyNotLoaded(RuntimeError):
    """Asked to generate or resume before any policy was loaded: in a pool, the sign of an
    actor that Ray restarted (it starts empty), which the pool answers by reloading."""


class WorkerGroupRuntime:
    """Tokenise, generate, detokenise for one worker group; load, offload, resume."""

    def __init__(
        self,
        name: str,
        store: StoreConfig,
        engine: str = "hf",
        dtype: str = "float32",
        max_prompt_tokens: int = 1024,
        cache_dir: str | None = None,
        threads: int | None = None,
        truncation: Literal["middle", "left"] = "middle",
        chat_template_kwargs: TemplateVariables | None = None,
    ) -> None:
        if threads:
            import torch  # noqa: PLC0415 - only where a runtime is made: the rollout driver never needs it

            torch.set_num_threads(threads)
        self.name = name
        self.store_config = store
        self.engine = make_engine(engine, dtype)
        self.max_prompt_tokens = max_prompt_tokens
        self.truncation = truncation
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.cache_dir = Path(cache_dir or Path.home() / ".cache" / "drmas" / "policies")
        self.version: str | None = None
        self.tokenizer = None
        self.stop_ids: list[int] = []

    # -- policy versions -----------------------------------------------------------------

    def load_policy(self, policy: PolicyRef) -> bool:
        """Make ``policy`` the held version; returns False when it already was (no reload)."""
        store = Store.from_config(self.store_config)
        artifact = store.open(policy.artifact)
        prefix = policy.prefix.rstrip("/") + "/" if policy.prefix else ""
        entries = sorted((n, e.sha256) for n, e in artifact.files.items() if n.startswith(prefix))
        if not any(name == f"{prefix}config.json" for name, _ in entries):
            raise FileNotFoundError(f"{artifact.uri} has no policy (config.json) under '{prefix}'")
        version = hashlib.sha256(repr(entries).encode()).hexdigest()[:16]
        if version == self.version:
            return False
        local = self.cache_dir / f"{self.name}-{version}"
        if not (local / "config.json").exists():
            staging = local.with_name(local.name + f".tmp-{os.getpid()}")
            shutil.rmtree(staging, ignore_errors=True)
            artifact.download(staging, prefix=policy.prefix)
            staging.rename(local)
        from drmas.models import load_tokenizer  # noqa: PLC0415 - transformers: in the actor only

        try:
            self.tokenizer = load_tokenizer(local)
            self.engine.load(local)
        except PolicyError as error:  # it names the local cache: say where the policy is stored
            raise PolicyError(f"{artifact.uri}: {str(error).removeprefix(f'{local}: ')}") from None
        self.stop_ids = _stop_ids(self.tokenizer)
        self.version = version
        return True

    # -- lifecycle ---------------------------------------------------------------------

    def offload(self) -> None:
        self.engine.offload()

    def resume(self) -> None:
        if self.version is None:
            raise PolicyNotLoaded(f"worker group {self.name!r}: resume() before load_policy()")
        self.engine.resume()

    def status(self) -> dict[str, object]:
        return {"name": self.name, "version": self.version, "resident": self.engine.resident, "pid": os.getpid()}

    # -- generation --------------------------------------------------------------------

    def generate(self, messages: list[str], sampling: SamplingConfig, seed: int) -> list[GenerationResult]:
        """One batched generate: every message is one user turn, chat-formatted."""
        if self.tokenizer is None:
            raise PolicyNotLoaded(f"worker group {self.name!r}: generate() before load_policy()")
        prompts = [self._encode(message) for message in messages]
        generations = self.engine.generate(prompts, sampling, self.stop_ids, seed)
        return [
            GenerationResult(
                prompt_ids=prompt,
                response_ids=g.response_ids,
                logprobs=g.logprobs,
                text=self.tokenizer.decode(g.response_ids, skip_special_tokens=True),
                finish_reason=g.finish_reason,
            )
            for prompt, g in zip(prompts, generations, strict=True)
        ]

    def _encode(self, message: str) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": message}],
            add_generation_prompt=True,
            tokenize=False,
            **self.chat_template_kwargs,
        )
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return truncate_prompt(ids, self.max_prompt_tokens, self.truncation)


def truncate_prompt(ids: list[int], max_tokens: int, truncation: Literal["middle", "left"]) -> list[int]:
    """At most ``max_tokens`` of ``ids``, cut as the reference's ``data.truncation`` cuts:
    'middle' keeps the first half and the last (the task statement at the start and the
    agent's role and generation prompt at the end both survive), 'left' keeps the end (the
    latest turns of a long multi-turn context, and the generation prompt)."""
    if len(ids) <= max_tokens:
        return ids
    if truncation == "left":
        return ids[len(ids) - max_tokens :]
    if truncation == "middle":
        half = max_tokens // 2
        return ids[:half] + ids[len(ids) - (max_tokens - half) :]
    raise ValueError(f"unknown truncation {truncation!r}; expected 'middle' or 'left'")


def _stop_ids(tokenizer) -> list[int]:
    """End-of-turn and end-of-text tokens: generation stops at any of them."""
    candidates = [tokenizer.eos_token_id]
    for token in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>"):
        token_id = tokenizer.convert_tokens_to_ids(token)
        if isinstance(token_id, int) and token_id != tokenizer.unk_token_id:
            candidates.append(token_id)
    return sorted({c for c in candidates if c is not None})
