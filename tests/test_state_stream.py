"""The optimizer state written as it is gathered and read one tensor at a time, the store's
streamed files, and the long wait of ranks 1..N for rank 0.

At the recipes' size the whole fp32 optimizer state is 48 GB (Qwen3-4B): it was gathered
whole on every rank and serialised into a second copy on rank 0. These tests check that the
streamed path writes the same state as the in-memory one, that a resume reads the tensors
one at a time, and that no file moves whole through memory on its way to or from the store.
"""

from __future__ import annotations

import datetime
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file

import drmas.infra.store as store_module
import drmas.training.state as state_module
from drmas.infra.store import CorruptArtifact, Store
from drmas.training.engines import wait_for_all
from drmas.training.state import (
    StateStream,
    TrainState,
    collect,
    load_state,
    state_mismatch,
    write_state,
)


def sample_stream() -> tuple[StateStream, dict[str, torch.Tensor]]:
    """A stream of every kind of tensor a state holds (the RNG's bytes, fp32 moments and
    masters of a bf16 model, a 0-dim and an empty one), and the tensors it yields."""
    generator = torch.Generator().manual_seed(0)
    tensors = {
        "rng/torch": torch.get_rng_state(),
        "optim/w/exp_avg": torch.randn(3, 5, generator=generator),
        "optim/w/exp_avg_sq": torch.rand(3, 5, generator=generator),
        "master/w": torch.randn(3, 5, generator=generator),
        "optim/b/exp_avg": torch.randn(7, generator=generator).to(torch.bfloat16),
        "optim/b/exp_avg_sq": torch.rand(7, generator=generator),
        "master/b": torch.randn(7, generator=generator),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
    }
    produced: list[str] = []

    def produce():
        for name, tensor in tensors.items():
            produced.append(name)
            yield tensor

    specs = [(name, tensor.dtype, tuple(tensor.shape)) for name, tensor in tensors.items()]
    return StateStream(specs, produce(), {"steps": {"w": 3.0, "b": 3.0}, "scheduler": {}}), tensors


def test_the_streamed_file_is_a_safetensors_file_of_the_same_tensors(tmp_path):
    stream, tensors = sample_stream()
    write_state(stream, tmp_path)
    read = load_file(str(tmp_path / "optimizer.safetensors"))  # safetensors' own reader
    assert read.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert read[name].dtype == tensor.dtype and torch.equal(read[name], tensor), name
    state = load_state(tmp_path)
    assert state.meta["steps"] == {"w": 3.0, "b": 3.0}
    assert all(torch.equal(state.tensors[name], tensor) for name, tensor in tensors.items())


def test_the_stream_and_the_state_held_in_memory_agree():
    stream, tensors = sample_stream()
    state = collect(stream)
    assert list(state.tensors) == list(tensors)
    assert all(torch.equal(state.tensors[name], tensors[name]) for name in tensors)


def test_a_tensor_other_than_announced_is_refused_naming_it(tmp_path):
    stream, _ = sample_stream()
    specs = [(name, torch.float64 if name == "master/w" else dtype, shape) for name, dtype, shape in stream.specs]
    with pytest.raises(ValueError, match=r"master/w: got torch.float32 \(3, 5\), announced torch.float64"):
        write_state(StateStream(specs, stream.tensors, stream.meta), tmp_path)


def test_a_stored_state_is_checked_and_read_one_tensor_at_a_time(tmp_path, monkeypatch):
    """Checking a state against the model reads its header only, and a resume asks for one
    tensor at a time: no read returns more than one tensor's bytes."""
    stream, tensors = sample_stream()
    write_state(stream, tmp_path)
    state = load_state(tmp_path)
    reads: list[str] = []
    original = state_module.StoredTensors.__getitem__

    def counted(self, name):
        reads.append(name)
        return original(self, name)

    monkeypatch.setattr(state_module.StoredTensors, "__getitem__", counted)
    shapes = {"w": torch.Size([3, 5]), "b": torch.Size([7])}
    assert state_mismatch(state, shapes) is None
    assert "rng/torch" in state.tensors and "master/w" in state.tensors
    assert reads == []
    assert "of shape (3, 5), but the parameter has shape (4, 5)" in state_mismatch(state, shapes | {"w": (4, 5)})
    assert torch.equal(state.tensors["optim/w/exp_avg"], tensors["optim/w/exp_avg"])
    assert reads == ["optim/w/exp_avg"]


def test_an_in_memory_state_and_a_stored_one_are_checked_alike(tmp_path):
    stream, tensors = sample_stream()
    write_state(stream, tmp_path)
    shapes = {"w": torch.Size([3, 6]), "b": torch.Size([7])}
    in_memory = TrainState(dict(tensors), {"steps": {"w": 3.0, "b": 3.0}})
    assert state_mismatch(load_state(tmp_path), shapes) == state_mismatch(in_memory, shapes)
    assert state_mismatch(in_memory, shapes) is not None


# -- the store's streamed files --------------------------------------------------------


class RecordingStream:
    """A pyarrow stream that records the size of every write and read."""

    def __init__(self, stream, sizes: list[int]) -> None:
        self._stream, self._sizes = stream, sizes

    def write(self, data) -> int:
        self._sizes.append(len(data))
        return self._stream.write(data)

    def read(self, size: int | None = None) -> bytes:
        data = self._stream.read() if size is None else self._stream.read(size)
        self._sizes.append(len(data))
        return data

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._stream.close()


class RecordingFileSystem:
    def __init__(self, fs) -> None:
        self._fs, self.writes, self.reads = fs, [], []

    def open_output_stream(self, path: str):
        return RecordingStream(self._fs.open_output_stream(path), self.writes)

    def open_input_stream(self, path: str):
        return RecordingStream(self._fs.open_input_stream(path), self.reads)

    def __getattr__(self, name: str):
        return getattr(self._fs, name)


def test_a_file_goes_to_and_from_the_store_in_chunks_and_is_verified(tmp_path, monkeypatch):
    monkeypatch.setattr(store_module, "CHUNK_BYTES", 1000)
    store = Store(str(tmp_path / "store"))
    payload = os.urandom(10_500)
    (tmp_path / "big.bin").write_bytes(payload)
    recording = RecordingFileSystem(store.fs)
    store.fs = recording
    with store.writer("run/optim") as out:
        out.put_file(tmp_path / "big.bin", "optimizer.safetensors")
    assert sum(recording.writes) == len(payload) and max(recording.writes) == 1000  # (the manifest: renamed in)
    artifact = store.open("run/optim")
    assert artifact.files["optimizer.safetensors"].size == len(payload)
    recording.reads.clear()
    local = artifact.download(tmp_path / "down")
    assert (local / "optimizer.safetensors").read_bytes() == payload
    assert sum(recording.reads) == len(payload) and max(recording.reads) == 1000
    assert artifact.read_bytes("optimizer.safetensors") == payload  # the manifest's sha256 is the file's


def test_a_corrupted_file_is_refused_on_download_and_no_copy_is_left(tmp_path):
    store = Store(str(tmp_path / "store"))
    (tmp_path / "state.bin").write_bytes(b"x" * 5000)
    with store.writer("run/optim") as out:
        out.put_file(tmp_path / "state.bin", "optimizer.safetensors")
    stored = tmp_path / "store" / "run" / "optim" / "optimizer.safetensors"
    stored.write_bytes(b"y" * 5000)
    with pytest.raises(CorruptArtifact, match="optimizer.safetensors: sha256 differs from the manifest"):
        store.open("run/optim").download(tmp_path / "down")
    stored.write_bytes(b"x" * 4000)
    with pytest.raises(CorruptArtifact, match="4000 bytes, but the manifest says 5000"):
        store.open("run/optim").download(tmp_path / "down")
    assert not (tmp_path / "down" / "optimizer.safetensors").exists()


# -- ranks 1..N wait for rank 0 ----------------------------------------------------------


def _rank(rank: int, rendezvous: str, results: dict) -> None:
    dist.init_process_group(
        "gloo", init_method=rendezvous, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=2)
    )
    try:
        if rank == 0:
            time.sleep(5)  # storing the policy: longer than the group's own timeout
        started = time.monotonic()
        wait_for_all(60)
        results[rank] = time.monotonic() - started
    finally:
        dist.destroy_process_group()


def test_the_other_ranks_wait_for_rank_0_longer_than_the_groups_timeout(tmp_path):
    """The group's collectives time out after 2 s here (10 minutes in a pool); rank 0 works
    alone for 5 s, and rank 1 waits for it instead of aborting."""
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank, args=(f"file://{tmp_path / 'rendezvous'}", results), nprocs=2, join=True)
        waited = dict(results)
    assert set(waited) == {0, 1}
    assert waited[1] > 3.0 > waited[0]
