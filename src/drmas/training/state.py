"""What an exact resume needs besides the weights: optimizer moments and steps, scheduler
counters and the RNG, saved as safetensors + JSON (never pickle) and refused when they belong to
another model."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "TrainState",
    "capture_state",
    "load_state",
    "restore_scheduler",
    "restore_state",
    "save_state",
    "saved_masters",
    "scheduler_state",
    "state_files",
    "state_mismatch",
]

log = logging.getLogger(__name__)


@dataclass
class TrainState:
    """Everything besides the weights that an exact resume needs."""

    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any]


def capture_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    masters: dict[str, torch.Tensor] | None = None,
) -> TrainState:
    """The optimizer's state by parameter name. ``masters``: the fp32 master weights that
    it steps instead of a bf16 model's parameters (mixed precision), saved too
    (``master/{name}``): resumed from the bf16 policy alone, a run would lose what the
    rounding hid."""
    names = {id(p): n for n, p in (masters or dict(model.named_parameters())).items()}
    tensors: dict[str, torch.Tensor] = {"rng/torch": torch.get_rng_state()}
    for name, master in (masters or {}).items():
        tensors[f"master/{name}"] = master.detach().cpu().contiguous()
    steps: dict[str, float] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state.get(param, {})
            for key, value in state.items():
                if torch.is_tensor(value) and value.dim() > 0:
                    tensors[f"optim/{names[id(param)]}/{key}"] = value.detach().cpu().contiguous()
                elif key == "step":
                    steps[names[id(param)]] = float(value)
    return TrainState(tensors, {"scheduler": scheduler_state(scheduler), "steps": steps})


def scheduler_state(scheduler: Any) -> dict[str, Any]:
    """The scheduler's counters; its lambdas are code, rebuilt from the config."""
    state = scheduler.state_dict() if scheduler is not None else {}
    return {key: value for key, value in state.items() if key != "lr_lambdas"}


def restore_scheduler(scheduler: Any, optimizer: Any, meta: dict[str, Any]) -> None:
    if scheduler is not None and meta.get("scheduler"):
        scheduler.load_state_dict({**scheduler.state_dict(), **meta["scheduler"]})
        for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr(), strict=True):
            group["lr"] = lr


def restore_state(
    state: TrainState,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    masters: dict[str, torch.Tensor] | None = None,
) -> bool:
    """Load ``state`` into the optimizer (and its saved masters into ``masters``); a state
    of another model (parameters this model does not have, or shapes other than its own)
    is refused before anything is applied. Returns whether masters were restored."""
    params = masters or dict(model.named_parameters())
    if problem := state_mismatch(state, {name: param.shape for name, param in params.items()}):
        raise ValueError(problem)
    saved = saved_masters(state, params) if masters else None
    for name, param in params.items():
        if saved is not None and name in saved:
            param.data.copy_(saved[name])
        if name not in state.meta["steps"]:
            continue
        slot = optimizer.state[param]
        slot["step"] = torch.tensor(state.meta["steps"][name])
        for key in ("exp_avg", "exp_avg_sq"):
            slot[key] = state.tensors[f"optim/{name}/{key}"].to(param.device, copy=True)
    restore_scheduler(scheduler, optimizer, state.meta)
    torch.set_rng_state(state.tensors["rng/torch"])
    return saved is not None


def saved_masters(state: TrainState, names: Iterable[str]) -> dict[str, torch.Tensor] | None:
    """The fp32 master weights ``state`` holds for these parameters (``state_mismatch``
    has checked that it holds one for each parameter it has moments for, or none), or
    None, said once in the log: a state saved by an fp32 run or before masters were
    saved; the masters then start from the bf16 weights, losing what the rounding hid."""
    saved = {name: state.tensors[f"master/{name}"] for name in names if f"master/{name}" in state.tensors}
    if saved:
        return saved
    log.warning(
        "the optimizer state holds no fp32 master weights (saved by an fp32 run or an older drmas): "
        "the masters start from the bf16 weights, and updates below bf16 resolution since they last "
        "showed in them are lost"
    )
    return None


def state_mismatch(state: TrainState, shapes: dict[str, torch.Size]) -> str | None:
    """How a saved optimizer state fails to fit parameters of these shapes, or None."""
    foreign = sorted(set(state.meta["steps"]) - set(shapes))
    if foreign:
        return (
            f"it holds state for {len(foreign)} parameter(s) this model does not have "
            f"(e.g. {foreign[0]!r}): the optimizer state of another model"
        )
    for name in state.meta["steps"]:
        for key in ("exp_avg", "exp_avg_sq"):
            saved = state.tensors.get(f"optim/{name}/{key}")
            if saved is None or saved.shape != shapes[name]:
                found = "missing" if saved is None else f"of shape {tuple(saved.shape)}"
                return f"the state for {name}.{key} is {found}, but the parameter has shape {tuple(shapes[name])}"
    masters = {key.removeprefix("master/"): value for key, value in state.tensors.items() if key.startswith("master/")}
    for name in sorted(set(masters) | set(state.meta["steps"])) if masters else ():
        if name not in shapes:
            return f"it holds a master weight for {name!r}, which this model does not have: the state of another model"
        if name not in masters or masters[name].shape != shapes[name]:
            found = "missing" if name not in masters else f"of shape {tuple(masters[name].shape)}"
            return f"the master weight of {name} is {found}, but the parameter has shape {tuple(shapes[name])}"
    return None


def state_files(state: TrainState) -> dict[str, bytes]:
    """The files of a saved state, by name: ``optimizer.safetensors`` and ``state.json``.

    In memory, so that a stage writes them straight into the store: through a local folder
    the optimizer state (12 bytes per parameter in fp32, 1.6 GB for a 135M model) went to
    disk twice and was read back once, which took most of a CPU update's save."""
    from safetensors.torch import save  # noqa: PLC0415

    return {
        "optimizer.safetensors": save(state.tensors),
        "state.json": json.dumps(state.meta, sort_keys=True).encode(),
    }


def save_state(state: TrainState, folder: Path) -> None:
    """The files of ``state_files`` in ``folder``, which ``load_state`` reads."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in state_files(state).items():
        (folder / name).write_bytes(data)


def load_state(folder: Path) -> TrainState:
    """The state ``save_state`` wrote; ValueError (naming the file) for anything else.

    Tensors come from safetensors and the rest from JSON: nothing is unpickled, so a
    pickle planted in their place is refused, never run.
    """
    from safetensors import SafetensorError  # noqa: PLC0415
    from safetensors.torch import load_file  # noqa: PLC0415

    try:
        tensors = load_file(str(folder / "optimizer.safetensors"))
    except (SafetensorError, OSError) as error:
        raise ValueError(f"optimizer.safetensors is not a safetensors file ({error})") from None
    try:
        meta = json.loads((folder / "state.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"state.json is not readable JSON ({error})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("steps"), dict) or "rng/torch" not in tensors:
        raise ValueError("not an optimizer state drmas wrote (state.json without 'steps' or no RNG state)")
    return TrainState(tensors, meta)
