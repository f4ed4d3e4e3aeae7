"""What an exact resume needs besides the weights: optimizer moments and steps, scheduler
counters and the RNG, saved as safetensors + JSON (never pickle) and refused when they belong to
another model."""

from __future__ import annotations

import json
import logging
import struct
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "STATE_FILE",
    "StateStream",
    "LazyTensors",
    "TrainState",
    "capture_state",
    "collect",
    "drain",
    "held_state",
    "checked_state",
    "load_state",
    "read_json",
    "read_range",
    "restore_scheduler",
    "restore_state",
    "save_state",
    "saved_masters",
    "scheduler_state",
    "state_files",
    "state_mismatch",
    "stream_state",
    "write_safetensors",
    "write_state",
]

log = logging.getLogger(__name__)


STATE_FILE = "optimizer.safetensors"
META_FILE = "state.json"


@dataclass
class TrainState:
    """Everything besides the weights that an exact resume needs. ``tensors`` is a dict, or,
    for a state read from disk, a ``StoredTensors`` that reads one tensor at a time."""

    tensors: Mapping[str, torch.Tensor]
    meta: dict[str, Any]


@dataclass
class StateStream:
    """A state as it is written: every tensor's name, dtype and shape up front, then the
    tensors one at a time, in that order, on the host.

    Producing a tensor can be a collective (DeepSpeed gathers each partitioned one from
    every rank): every rank of a group consumes the whole stream, in order, and only the
    writing rank keeps what it gets, one tensor at a time. So no rank ever holds the whole
    optimizer state (12 bytes a parameter: 48 GB for a 4B model) in host memory, and no
    serialised second copy of it is made."""

    specs: list[tuple[str, torch.dtype, tuple[int, ...]]]
    tensors: Iterator[torch.Tensor]
    meta: dict[str, Any]


def stream_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    masters: dict[str, torch.Tensor] | None = None,
) -> StateStream:
    """The optimizer's state by parameter name, as a stream. ``masters``: the fp32 master
    weights that it steps instead of a bf16 model's parameters (mixed precision), saved too
    (``master/{name}``): resumed from the bf16 policy alone, a run would lose what the
    rounding hid."""
    held, steps = held_state(model, optimizer, masters)
    sources = [("rng/torch", torch.get_rng_state()), *held.items()]
    specs = [(name, tensor.dtype, tuple(tensor.shape)) for name, tensor in sources]
    tensors = (tensor.detach().cpu().contiguous() for _, tensor in sources)
    return StateStream(specs, tensors, {"scheduler": scheduler_state(scheduler), "steps": steps})


def held_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, masters: dict[str, torch.Tensor] | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """The live tensors of an optimizer that holds its state whole (``master/{name}``,
    ``optim/{name}/{key}``) and each parameter's step count."""
    names = {id(p): n for n, p in (masters or dict(model.named_parameters())).items()}
    tensors = {f"master/{name}": master for name, master in (masters or {}).items()}
    steps: dict[str, float] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            for key, value in optimizer.state.get(param, {}).items():
                if torch.is_tensor(value) and value.dim() > 0:
                    tensors[f"optim/{names[id(param)]}/{key}"] = value
                elif key == "step":
                    steps[names[id(param)]] = float(value)
    return tensors, steps


def capture_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    masters: dict[str, torch.Tensor] | None = None,
) -> TrainState:
    """``stream_state``, held whole in memory."""
    return collect(stream_state(model, optimizer, scheduler, masters))


def collect(stream: StateStream) -> TrainState:
    """The whole state in memory (tests, small models; the update writes the stream)."""
    tensors = {name: tensor for (name, _, _), tensor in zip(stream.specs, stream.tensors, strict=True)}
    return TrainState(tensors, stream.meta)


def drain(stream: StateStream) -> None:
    """Take part in producing the stream (its collectives) without keeping any of it."""
    for _ in stream.tensors:
        pass


_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def write_state(stream: StateStream, folder: Path) -> None:
    """The state in ``folder`` as ``optimizer.safetensors`` and ``state.json``, written as
    the stream produces it (``write_safetensors``). The file is what
    ``safetensors.torch.save`` writes for the same tensors, bar the order of the data."""
    folder.mkdir(parents=True, exist_ok=True)
    write_safetensors(folder / STATE_FILE, stream.specs, stream.tensors)
    (folder / META_FILE).write_text(json.dumps(stream.meta, sort_keys=True))


def write_safetensors(
    path: Path, specs: list[tuple[str, torch.dtype, tuple[int, ...]]], tensors: Iterable[torch.Tensor]
) -> None:
    """A safetensors file written as ``tensors`` come: the header first (it is known from
    the specs), then each tensor's bytes, so that no more than one tensor is held."""
    header: dict[str, Any] = {}
    offset = 0
    for name, dtype, shape in specs:
        size = _numel(shape) * dtype.itemsize
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(encoded)) + encoded)
        for (name, dtype, shape), tensor in zip(specs, tensors, strict=True):
            if tensor.dtype != dtype or tuple(tensor.shape) != shape:
                raise ValueError(f"{name}: got {tensor.dtype} {tuple(tensor.shape)}, announced {dtype} {shape}")
            out.write(tensor.contiguous().view(-1).view(torch.uint8).numpy().data)


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


class LazyTensors(Mapping[str, torch.Tensor]):
    """Tensors read from disk when asked for, whose shapes are known without reading them."""

    def shape(self, name: str) -> tuple[int, ...]:
        raise NotImplementedError

    def read_range(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Elements [start, stop) of the tensor flattened."""
        return self[name].reshape(-1)[start:stop]


class StoredTensors(LazyTensors):
    """The tensors of a safetensors file, read one at a time when asked for (a resume never
    holds the whole optimizer state); ``shape`` reads the header alone."""

    def __init__(self, path: Path) -> None:
        from safetensors import safe_open  # noqa: PLC0415

        self._file = safe_open(str(path), framework="pt")
        self._names = list(self._file.keys())
        self._known = set(self._names)

    def __contains__(self, name: object) -> bool:  # Mapping's would read the tensor
        return name in self._known

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._known:
            raise KeyError(name)
        return self._file.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._file.get_slice(name).get_shape())

    @classmethod
    def open(cls, path: Path) -> StoredTensors:
        """The file at ``path``; ValueError naming it when it is missing or not safetensors."""
        from safetensors import SafetensorError  # noqa: PLC0415

        try:
            return cls(path)
        except (SafetensorError, OSError) as error:
            raise ValueError(f"{path.name} is not a safetensors file ({error})") from None


def _shape(tensors: Mapping[str, torch.Tensor], name: str) -> tuple[int, ...] | None:
    """A tensor's shape without reading it (None: not there)."""
    if name not in tensors:
        return None
    return tensors.shape(name) if isinstance(tensors, LazyTensors) else tuple(tensors[name].shape)


def read_range(tensors: Mapping[str, torch.Tensor], name: str, start: int, stop: int) -> torch.Tensor:
    """Elements [start, stop) of the tensor ``name`` flattened: what a rank holds of it. A
    state in per-rank shards reads only the shards that hold them; any other reads the
    tensor (old single-file states, states held in memory)."""
    if isinstance(tensors, LazyTensors):
        return tensors.read_range(name, start, stop)
    return tensors[name].reshape(-1)[start:stop]


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


class _Masters(Mapping[str, torch.Tensor]):
    """A state's master weights by parameter name, each read when asked for."""

    def __init__(self, state: TrainState, names: list[str]) -> None:
        self._state, self._names, self._known = state, names, set(names)

    def __contains__(self, name: object) -> bool:  # Mapping's would read the tensor
        return name in self._known

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._known:
            raise KeyError(name)
        return self._state.tensors[f"master/{name}"]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def saved_masters(state: TrainState, names: Iterable[str]) -> Mapping[str, torch.Tensor] | None:
    """The fp32 master weights ``state`` holds for these parameters (``state_mismatch``
    has checked that it holds one for each parameter it has moments for, or none), read one
    at a time, or None, said once in the log: a state saved by an fp32 run or before masters
    were saved; the masters then start from the bf16 weights, losing what the rounding hid."""
    held = [name for name in names if f"master/{name}" in state.tensors]
    if held:
        return _Masters(state, held)
    log.warning(
        "the optimizer state holds no fp32 master weights (saved by an fp32 run or an older drmas): "
        "the masters start from the bf16 weights, and updates below bf16 resolution since they last "
        "showed in them are lost"
    )
    return None


def state_mismatch(state: TrainState, shapes: dict[str, torch.Size]) -> str | None:
    """How a saved optimizer state fails to fit parameters of these shapes, or None (read
    from the shapes alone: no tensor is loaded)."""
    foreign = sorted(set(state.meta["steps"]) - set(shapes))
    if foreign:
        return (
            f"it holds state for {len(foreign)} parameter(s) this model does not have "
            f"(e.g. {foreign[0]!r}): the optimizer state of another model"
        )
    for name in state.meta["steps"]:
        for key in ("exp_avg", "exp_avg_sq"):
            saved = _shape(state.tensors, f"optim/{name}/{key}")
            if saved != tuple(shapes[name]):
                found = "missing" if saved is None else f"of shape {saved}"
                return f"the state for {name}.{key} is {found}, but the parameter has shape {tuple(shapes[name])}"
    masters = {key.removeprefix("master/") for key in state.tensors if key.startswith("master/")}
    for name in sorted(masters | set(state.meta["steps"])) if masters else ():
        if name not in shapes:
            return f"it holds a master weight for {name!r}, which this model does not have: the state of another model"
        saved = _shape(state.tensors, f"master/{name}")
        if saved != tuple(shapes[name]):
            found = "missing" if saved is None else f"of shape {saved}"
            return f"the master weight of {name} is {found}, but the parameter has shape {tuple(shapes[name])}"
    return None


def state_files(state: TrainState) -> dict[str, bytes]:
    """The files of a saved state, by name, in memory: for small states (tests)."""
    from safetensors.torch import save  # noqa: PLC0415

    return {STATE_FILE: save(dict(state.tensors)), META_FILE: json.dumps(state.meta, sort_keys=True).encode()}


def save_state(state: TrainState, folder: Path) -> None:
    """The files of ``state_files`` in ``folder``, which ``load_state`` reads."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in state_files(state).items():
        (folder / name).write_bytes(data)


def load_state(folder: Path) -> TrainState:
    """The state ``write_state`` or ``save_state`` wrote (one file), its tensors read when
    asked for; ValueError (naming the file) for anything else; a sharded state is read by
    ``drmas.training.shards.load_optimizer_state``.

    Tensors come from safetensors and the rest from JSON: nothing is unpickled, so a
    pickle planted in their place is refused, never run.
    """
    return checked_state(StoredTensors.open(folder / STATE_FILE), read_json(folder, META_FILE))


def checked_state(tensors: LazyTensors, meta: Any) -> TrainState:
    """A state of these tensors and JSON, or ValueError when it is not one drmas wrote."""
    if not isinstance(meta, dict) or not isinstance(meta.get("steps"), dict) or "rng/torch" not in tensors:
        raise ValueError("not an optimizer state drmas wrote (state.json without 'steps' or no RNG state)")
    return TrainState(tensors, meta)


def read_json(folder: Path, name: str) -> Any:
    try:
        return json.loads((folder / name).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{name} is not readable JSON ({error})") from None
