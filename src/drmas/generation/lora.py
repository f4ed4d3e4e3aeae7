"""LoRA policies as the rest of drmas reads them: a stored adapter and the base it adapts.

A LoRA worker group's policy artifact (``models.NAME.lora``) holds the adapter in PEFT
layout (``adapter_config.json``, ``adapter_model.safetensors``), the tokenizer, and
``base_policy.json``: the store path of the whole policy it adapts (the run's initial or
warm-started policy) with that artifact's manifest fingerprint, its source and revision.
The rollout engines generate from the merged weights (``merge_lora``), at full speed and
without LoRA support of their own: after an update they take them in memory
(``Engine.set_weights``), as a full fine-tune's; a worker that loads the policy from the
store writes them once per version as a whole policy folder in its local cache, which the
HF engine loads and SGLang loads and reloads (``update_weights_from_disk`` after a memory
release) like any policy. The training side of LoRA is ``drmas.training.lora``.

To use a stored LoRA policy elsewhere: ``peft.PeftModel.from_pretrained(base, folder)``
with ``base`` loaded from ``base_policy.json``'s artifact (``adapter_config.json``'s
``base_model_name_or_path`` is its store URI: on a local store,
``AutoModelForCausalLM.from_pretrained(folder)`` finds the base by itself), then
``merge_and_unload()`` for a plain Hugging Face model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from drmas.config import PolicyError
from drmas.infra.layout import PolicyRef
from drmas.infra.store import ArtifactNotFound, CorruptArtifact, Store

if TYPE_CHECKING:
    import torch

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "BASE_POLICY", "lora_base", "merge_lora", "read_adapter"]

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
"""A LoRA policy's adapter files (PEFT layout)."""
BASE_POLICY = "base_policy.json"
"""In a LoRA policy: the base policy artifact it adapts (``artifact``, ``prefix``,
``manifest``, ``uri``, ``source``, ``revision``)."""


def lora_base(store: Store, policy: PolicyRef) -> PolicyRef | None:
    """The base policy that the LoRA policy at ``policy`` adapts, or None for a whole
    policy. A base that is gone or changed since the adapter was trained on it is refused
    (CorruptArtifact naming both): the adapter means nothing on other weights."""
    artifact = store.open(policy.artifact)
    prefix = policy.prefix.rstrip("/") + "/" if policy.prefix else ""
    if f"{prefix}{BASE_POLICY}" not in artifact.files:
        return None
    record = artifact.read_json(f"{prefix}{BASE_POLICY}")
    base = PolicyRef(record["artifact"], record.get("prefix", ""))
    try:
        found = store.fingerprint(base.artifact)
    except ArtifactNotFound:
        raise CorruptArtifact(
            f"{store.uri(base.artifact)}: the base of the LoRA policy {artifact.uri} is missing"
        ) from None
    if found != record["manifest"]:
        raise CorruptArtifact(
            f"{store.uri(base.artifact)}: changed since the LoRA policy {artifact.uri} was trained on it"
        )
    return base


def read_adapter(folder: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A LoRA adapter saved in PEFT layout: its tensors and its config, from safetensors
    and JSON only (peft's own loader falls back to a pickled ``adapter_model.bin``);
    PolicyError naming the folder otherwise."""
    from safetensors import SafetensorError  # noqa: PLC0415 - torch only where weights are read
    from safetensors.torch import load_file  # noqa: PLC0415

    if not (folder / ADAPTER_WEIGHTS).is_file():
        raise PolicyError(f"{folder}: a LoRA policy without {ADAPTER_WEIGHTS} (adapters load from safetensors only)")
    try:
        tensors = load_file(str(folder / ADAPTER_WEIGHTS))
        config = json.loads((folder / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError, SafetensorError) as error:
        raise PolicyError(f"{folder}: not a readable LoRA adapter ({error})") from None
    return tensors, config


def merge_lora(
    weights: dict[str, torch.Tensor], adapter: dict[str, torch.Tensor], config: dict[str, Any]
) -> dict[str, torch.Tensor]:
    """The whole weights of a LoRA policy, which the rollout engines generate from: every
    adapted weight W + alpha / r x B A, summed in fp32 and rounded once to W's dtype
    (peft's ``merge_and_unload`` up to that rounding). ``weights``: the base's, by their
    Hugging Face names; ``adapter`` and ``config``: as PEFT saves them. The same function
    serves an update's in-memory hand-over and a worker loading from the store, so both
    give the engine the same bytes."""
    unsupported = ("use_rslora", "use_dora", "fan_in_fan_out", "rank_pattern", "alpha_pattern")
    if any(config.get(key) for key in unsupported):
        raise PolicyError(f"only plain LoRA adapters merge (none of {', '.join(unsupported)})")
    scaling = config["lora_alpha"] / config["r"]
    merged = dict(weights)
    for key, down in adapter.items():
        if not key.endswith(".lora_A.weight"):
            continue
        module = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
        base = weights.get(f"{module}.weight")
        if base is None:
            raise PolicyError(f"the adapter's {key} adapts {module}, which the base model does not have")
        up = adapter[key.replace(".lora_A.", ".lora_B.")]
        merged[f"{module}.weight"] = (base.float() + scaling * (up.float() @ down.float())).to(base.dtype)
    return merged
