"""LoRA worker groups (``models.NAME.lora``): the adapters peft puts on a policy, what of
them trains and is saved, and the KL reference they give for free.

- ``with_lora``: a base model with fresh adapters (A random, B zero: the policy starts as
  its base), or the adapters of an earlier update (their saved tensors); the base is
  frozen, so every engine's optimizer holds the adapters' parameters only (its state too).
- ``BaseReference``: the KL reference of a LoRA group is its base policy, which is the
  same model with the adapter switched off (``PeftModel.disable_adapter``): no second
  copy of the weights.
- ``split_weights``: the base's weights under their Hugging Face names and the adapter as
  PEFT saves it, which ``drmas.models.merge_lora`` merges into what the rollout engine
  generates from.

The loading of a stored adapter (safetensors only) and the merge live in ``drmas.models``:
the rollout workers (``drmas.generation``) need them too.
"""

from __future__ import annotations

from typing import Any

import torch

from drmas.config import LoraSpec

__all__ = ["BaseReference", "adapter_config", "split_weights", "with_lora"]

ADAPTER = "default"
"""The one adapter drmas gives a model (peft's default name)."""


def with_lora(model: torch.nn.Module, spec: LoraSpec, seed: int, saved: dict[str, torch.Tensor] | None = None):
    """``model`` wrapped by peft with the adapters ``spec`` asks for: fresh ones drawn from
    ``seed`` (the same adapters wherever a run starts), or ``saved`` (PEFT's saved layout,
    ``drmas.models.read_adapter``). A saved adapter of another rank or other targets is
    refused (ValueError naming the tensor) rather than half loaded.

    Adapters of a bf16 base are kept in fp32 (peft's ``autocast_adapter_dtype``): they are
    the master weights of a LoRA policy, and its optimizer state is fp32 with them."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict  # noqa: PLC0415 - LoRA groups only

    config = LoraConfig(
        r=spec.rank,
        lora_alpha=spec.alpha,
        lora_dropout=spec.dropout,
        target_modules=list(spec.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        peft_model = get_peft_model(model, config, autocast_adapter_dtype=True)
    if saved is not None:
        try:
            result: Any = set_peft_model_state_dict(peft_model, saved)
        except RuntimeError as error:  # a shape that differs: another rank
            raise ValueError(
                f"the adapter does not fit models.*.lora ({str(error).splitlines()[-1].strip()})"
            ) from None
        missing = [name for name in result.missing_keys if "lora_" in name]
        if result.unexpected_keys or missing:
            raise ValueError(
                f"the adapter does not fit models.*.lora: unknown {sorted(result.unexpected_keys)[:3]}, "
                f"missing {sorted(missing)[:3]}"
            )
    return peft_model


class BaseReference(torch.nn.Module):
    """The LoRA policy with its adapter switched off: the base it started from, which is
    the KL reference of a LoRA group. It holds the policy without registering it, so that
    moving or listing this module's parameters touches nothing (there are none)."""

    def __init__(self, policy: torch.nn.Module) -> None:
        super().__init__()
        self._policy: list[Any] = [policy]

    def forward(self, **inputs: Any) -> Any:
        policy = self._policy[0]
        with policy.disable_adapter():
            return policy(**inputs)


def adapter_config(model) -> dict[str, Any]:
    """The adapter's config as PEFT saves it (adapter_config.json)."""
    return model.peft_config[ADAPTER].to_dict()


def split_weights(model) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the base's weights under their Hugging Face names, the adapter as PEFT saves it):
    what ``drmas.models.merge_lora`` turns into the whole weights the rollout engines take."""
    from peft import get_peft_model_state_dict  # noqa: PLC0415

    base = {
        name.replace(".base_layer.", "."): tensor.detach()
        for name, tensor in model.get_base_model().state_dict().items()
        if ".lora_" not in name
    }
    adapter = {name: tensor.detach() for name, tensor in get_peft_model_state_dict(model).items()}
    return base, adapter
