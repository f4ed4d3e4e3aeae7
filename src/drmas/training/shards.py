"""The optimizer state saved per rank: each rank writes and stores only the part it holds,
and a resume at any number of ranks reads only the parts it needs.

At the recipes' size the whole fp32 optimizer state is 48 GB (Qwen3-4B). Gathered to one
rank, it funnelled through that rank's host memory and upload, and every rank of a resume
downloaded all of it. Here, at a save, every rank writes the contiguous range of each
flattened tensor that its partition holds (``Piece``) as a 1-D tensor of its own file,
``optimizer-{rank:05d}-of-{world:05d}.safetensors``, streamed one tensor at a time
(``state.write_safetensors``), and uploads it; rank 0 adds ``index.json``, which records
each whole tensor's dtype and shape and where each of its chunks is (file, key, start,
stop), and ``state.json`` (scheduler, steps), and commits the artifact (``drmas.stages.optimizer_store.store_shards``).
A resume reads each rank's ranges from the chunks that overlap them (``ShardedTensors``),
downloading a shard file only when a range first needs it, so the saved number of ranks
does not bind the resumed one.

The layout is torch.distributed.checkpoint's, flattened: DCP's ``Metadata`` maps each
tensor's name to a ``TensorStorageMetadata`` (its dtype and size, and the
``ChunkStorageMetadata`` offsets and sizes of the chunks that ranks wrote), and its storage
data maps each chunk to a file and a place in it (torch/distributed/checkpoint/metadata.py:
24-32, 114-151; filesystem.py:75-84). DCP itself cannot be used: its planners chunk
DTensor and ShardedTensor, and DeepSpeed's partitions are ranges of flat buffers, one
per parameter group, that no such tensor describes; DeepSpeed's own universal checkpoint
writes every rank's whole optimizer state with ``torch.save`` (pickle), which drmas
never reads, and converts it offline. Here a chunk is a 1-D range [start, stop) of the
flattened tensor, and its place is a key of a safetensors file (the tensor's own name:
a rank holds one range of each tensor).

Old states (one ``optimizer.safetensors``, ``state.write_state``) still load: every
reader takes a range through ``state.read_range``, whatever the layout.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from drmas.training.state import (
    META_FILE,
    LazyTensors,
    TrainState,
    checked_state,
    held_state,
    load_state,
    read_json,
    scheduler_state,
    write_safetensors,
)

__all__ = [
    "INDEX_FILE",
    "RNG_FILE",
    "Piece",
    "ShardStream",
    "ShardedTensors",
    "even_pieces",
    "is_shard_file",
    "load_optimizer_state",
    "replicated_stream",
    "shard_file",
    "shard_index",
    "write_shard",
]

INDEX_FILE = "index.json"
RNG_FILE = "rng.safetensors"
INDEX_FORMAT = "drmas.optimizer-shards/1"
_SHARD_NAME = re.compile(r"optimizer-\d{5}-of-\d{5}\.safetensors")
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "U8": torch.uint8}
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


def shard_file(rank: int, world: int) -> str:
    return f"optimizer-{rank:05d}-of-{world:05d}.safetensors"


def is_shard_file(name: str) -> bool:
    return bool(_SHARD_NAME.fullmatch(name.rsplit("/", 1)[-1]))


@dataclass
class Piece:
    """What this rank holds of one tensor of the state: the whole tensor's name, dtype and
    shape, the range [start, stop) of it flattened that this rank writes (empty: none),
    and a live 1-D view of that range (read at a save; a restore copies into it)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    stop: int
    view: Callable[[], torch.Tensor]


@dataclass
class ShardStream:
    """One rank's part of a state as it is written: its pieces, in the same order on every
    rank, the state's scheduler and steps (every rank's are the same) and this rank's RNG.
    Rank 0's RNG is stored, in a file of its own (``RNG_FILE``): a resume gives every rank
    rank 0's, as it has always done, and no rank downloads rank 0's shard for it."""

    pieces: list[Piece]
    meta: dict[str, Any]
    rng: torch.Tensor

    @classmethod
    def of(cls, pieces: list[Piece], meta: dict[str, Any]) -> ShardStream:
        return cls(pieces, meta, torch.get_rng_state())

    def rng_file(self) -> bytes:
        from safetensors.torch import save  # noqa: PLC0415

        return save({"rng/torch": self.rng})


def even_pieces(tensors: dict[str, torch.Tensor], rank: int, world: int) -> list[Piece]:
    """A state every rank holds whole (the torch engine's, ZeRO-0's) split evenly: each
    rank writes 1/world of every tensor, so that every rank uploads as much and none
    funnels the whole state (a resume reads all of them, since every rank needs the
    whole state)."""
    pieces = []
    for name, tensor in tensors.items():
        start, stop = tensor.numel() * rank // world, tensor.numel() * (rank + 1) // world
        view = partial(torch.narrow, tensor.detach().reshape(-1), 0, start, stop - start)
        pieces.append(Piece(name, tensor.dtype, tuple(tensor.shape), start, stop, view))
    return pieces


def replicated_stream(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    masters: dict[str, torch.Tensor] | None,
    rank: int,
    world: int,
) -> ShardStream:
    """Rank ``rank``'s shard of an optimizer every rank holds whole (``state.held_state``):
    an even share of each tensor (``even_pieces``)."""
    tensors, steps = held_state(model, optimizer, masters)
    meta = {"scheduler": scheduler_state(scheduler), "steps": steps}
    return ShardStream.of(even_pieces(tensors, rank, world), meta)


def write_shard(stream: ShardStream, folder: Path, rank: int, world: int) -> list[list[Any]]:
    """This rank's file in ``folder``, written one piece at a time (each copied to the host
    as it is written); the chunks it holds, as ``[name, start, stop]``."""
    held = [piece for piece in stream.pieces if piece.stop > piece.start]
    folder.mkdir(parents=True, exist_ok=True)
    specs: list[tuple[str, torch.dtype, tuple[int, ...]]] = [
        (piece.name, piece.dtype, (piece.stop - piece.start,)) for piece in held
    ]
    write_safetensors(folder / shard_file(rank, world), specs, (piece.view().detach().cpu() for piece in held))
    return [[piece.name, piece.start, piece.stop] for piece in held]


def shard_index(stream: ShardStream, chunks_by_rank: list[list[list[Any]]]) -> dict[str, Any]:
    """``index.json``: every tensor's dtype and shape and its chunks, by rank (the RNG's
    in ``RNG_FILE``)."""
    world, rng = len(chunks_by_rank), stream.rng
    tensors: dict[str, Any] = {
        piece.name: {"dtype": _NAMES[piece.dtype], "shape": list(piece.shape), "chunks": []} for piece in stream.pieces
    }
    rng_chunk = {"file": RNG_FILE, "key": "rng/torch", "start": 0, "stop": rng.numel()}
    tensors["rng/torch"] = {"dtype": _NAMES[rng.dtype], "shape": list(rng.shape), "chunks": [rng_chunk]}
    for rank, chunks in enumerate(chunks_by_rank):
        for name, start, stop in chunks:
            tensors[name]["chunks"].append({"file": shard_file(rank, world), "key": name, "start": start, "stop": stop})
    return {"format": INDEX_FORMAT, "world": world, "tensors": tensors}


@dataclass(frozen=True)
class _Chunk:
    file: str
    key: str
    start: int
    stop: int


class ShardedTensors(LazyTensors):
    """The tensors of a sharded state: each range read from the chunks that overlap it,
    each shard file taken from ``fetch`` (a download) the first time a range needs it.
    ``index.json`` is input: its files must be shard names, and each tensor's chunks must
    tile it exactly (ValueError naming the tensor or the file otherwise)."""

    def __init__(self, index: Any, fetch: Callable[[str], Path]) -> None:
        if not isinstance(index, dict) or index.get("format") != INDEX_FORMAT:
            raise ValueError(f"{INDEX_FILE}: not an index of optimizer shards ({INDEX_FORMAT})")
        self._fetch, self._open_files = fetch, {}  # type: ignore[var-annotated]
        self._specs: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        self._chunks: dict[str, list[_Chunk]] = {}
        try:
            for name, entry in index["tensors"].items():
                self._specs[name] = (_DTYPES[entry["dtype"]], tuple(int(size) for size in entry["shape"]))
                self._chunks[name] = sorted(
                    (_Chunk(str(c["file"]), str(c["key"]), int(c["start"]), int(c["stop"])) for c in entry["chunks"]),
                    key=lambda chunk: chunk.start,
                )
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise ValueError(f"{INDEX_FILE}: unreadable ({error!r})") from None
        for name in self._specs:
            self._check_tiling(name)

    def _check_tiling(self, name: str) -> None:
        covered = 0
        for chunk in self._chunks[name]:
            if not _SHARD_NAME.fullmatch(chunk.file) and chunk.file != RNG_FILE:
                raise ValueError(f"{INDEX_FILE}: {chunk.file!r} is not an optimizer shard's name")
            if chunk.start != covered or chunk.stop <= chunk.start:
                break
            covered = chunk.stop
        if covered != _numel(self._specs[name][1]) or len({c.start for c in self._chunks[name]}) != len(
            self._chunks[name]
        ):
            raise ValueError(f"{INDEX_FILE}: the chunks of {name} do not cover it exactly once")

    def __contains__(self, name: object) -> bool:  # Mapping's would read the tensor
        return name in self._specs

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._specs:
            raise KeyError(name)
        return self.read_range(name, 0, _numel(self._specs[name][1])).reshape(self._specs[name][1])

    def __iter__(self) -> Iterator[str]:
        return iter(self._specs)

    def __len__(self) -> int:
        return len(self._specs)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._specs[name][1]

    def read_range(self, name: str, start: int, stop: int) -> torch.Tensor:
        """The range read from each chunk that overlaps it; from one chunk, its slice is
        the range itself (no second copy: a restore holds one copy of a rank's range)."""
        dtype = self._specs[name][0]
        overlapping = [chunk for chunk in self._chunks[name] if chunk.start < stop and start < chunk.stop]
        if len(overlapping) == 1:
            (chunk,) = overlapping
            return self._slice(chunk, dtype)[start - chunk.start : stop - chunk.start]
        out = torch.empty(stop - start, dtype=dtype)
        for chunk in overlapping:
            low, high = max(start, chunk.start), min(stop, chunk.stop)
            out[low - start : high - start] = self._slice(chunk, dtype)[low - chunk.start : high - chunk.start]
        return out

    def _slice(self, chunk: _Chunk, dtype: torch.dtype) -> Any:
        """The chunk's tensor in its file, sliced lazily (safetensors reads only the slice)."""
        stored = self._file(chunk.file).get_slice(chunk.key)
        if stored.get_shape() != [chunk.stop - chunk.start] or stored.get_dtype() != _NAMES[dtype]:
            raise ValueError(
                f"{chunk.file}: {chunk.key} is {stored.get_dtype()} {stored.get_shape()}, but {INDEX_FILE} says "
                f"{_NAMES[dtype]} [{chunk.stop - chunk.start}]"
            )
        return stored

    def _file(self, name: str) -> Any:
        from safetensors import SafetensorError, safe_open  # noqa: PLC0415

        if name not in self._open_files:
            try:
                self._open_files[name] = safe_open(str(self._fetch(name)), framework="pt")
            except (SafetensorError, OSError) as error:
                raise ValueError(f"{name} is missing or not a safetensors file ({error})") from None
        return self._open_files[name]


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def load_optimizer_state(folder: Path, fetch: Callable[[str], Path] | None = None) -> TrainState:
    """The state the sharded save wrote, or ``write_state`` or ``save_state`` (one file,
    ``state.load_state``), its tensors read when asked for; ValueError (naming the file) for
    anything else. A sharded state's files are taken from ``fetch`` (by default: ``folder``),
    each when a tensor first needs it, so that a rank reads only the shards that hold its part.

    Tensors come from safetensors and the rest from JSON: nothing is unpickled, so a
    pickle planted in their place is refused, never run.
    """
    if not (folder / INDEX_FILE).exists():
        return load_state(folder)
    tensors = ShardedTensors(read_json(folder, INDEX_FILE), fetch or (lambda name: folder / name))
    return checked_state(tensors, read_json(folder, META_FILE))
