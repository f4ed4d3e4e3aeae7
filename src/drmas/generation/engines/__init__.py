"""Rollout engines: the one interface every worker group generates through.

An engine turns batches of prompt token ids into responses, with the log-probability of
every sampled token under the sampling policy (what the update uses as the old policy).
Its lifecycle lets N models share one device pool: ``load`` a policy version from a
local folder (HF layout), ``offload`` to release the memory, ``resume`` to take it back,
``set_weights`` to take an update's new weights in memory (no store round-trip).

    base    the Engine protocol, a Generation, request_seeds: what the engines share
    hf      transformers on CPU (or one GPU): the default on one machine
    sglang  SGLang's offline engine on GPUs (the gpu image; imported only when chosen)
"""

from __future__ import annotations

from drmas.generation.engines.base import Engine, Generation, request_seeds

__all__ = ["Engine", "Generation", "make_engine", "request_seeds"]


def make_engine(kind: str, dtype: str) -> Engine:
    """The engine named in ``rollout.engine``; SGLang is imported only when chosen."""
    if kind == "hf":
        from drmas.generation.engines.hf import HFEngine  # noqa: PLC0415

        return HFEngine(dtype)
    if kind == "sglang":
        from drmas.generation.engines.sglang import SGLangEngine  # noqa: PLC0415

        return SGLangEngine(dtype)
    raise ValueError(f"unknown rollout engine {kind!r}; expected 'hf' or 'sglang'")
