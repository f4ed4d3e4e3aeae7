"""The optimizer state's store transaction: every rank's shard of it
(``drmas.training.shards``) stored as one artifact, committed by rank 0 once every rank's
upload is in, or left without a manifest when any rank fails."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from drmas.infra.store import FileEntry, Store, StoreError
from drmas.training.engines.base import exchange_json, host_group, rank_and_world
from drmas.training.shards import INDEX_FILE, RNG_FILE, ShardStream, shard_file, shard_index, write_shard
from drmas.training.state import META_FILE

__all__ = ["store_shards"]


def store_shards(
    stream: ShardStream, store: Store, path: str, overwrite: bool, meta: dict[str, Any], scratch: Path, timeout_s: float
) -> None:
    """Every rank's shard stored as one artifact at ``path`` (a collective: every rank of
    the group calls it). Each rank writes its file to ``scratch`` and uploads it; rank 0
    opens the artifact first (clearing leftovers), then collects the ranks' chunks and
    file entries (JSON over a gloo group with ``timeout_s``: an upload can take an hour),
    writes the index and the state's JSON and commits. Every rank takes part in the same
    three exchanges whatever fails, so that a failure anywhere reaches every rank: the
    artifact is then left without a manifest (rank 0's writer discards it) and every rank
    raises."""
    rank, world = rank_and_world()
    name = shard_file(rank, world)
    chunks = write_shard(stream, scratch, rank, world)
    with host_group(timeout_s) as group:
        writer = store.writer(path, overwrite=overwrite, meta=meta) if rank == 0 else None
        failure = _attempt(writer.__enter__) if writer is not None else None
        if failure is not None:
            writer = None  # not opened (an existing artifact, a lost lease): nothing to discard
        failure = exchange_json({"error": failure}, group)[0]["error"]  # 1: the artifact is open
        report = {"error": failure} if failure else _attempt_report(lambda: _upload(store, writer, path, scratch, name))
        reports = exchange_json({**report, "chunks": chunks}, group)  # 2: every rank's upload
        if writer is not None:
            failure = next((f"rank {r}: {got['error']}" for r, got in enumerate(reports) if got["error"]), None)
            failure = _finish(writer, reports, stream, failure)
        failure = exchange_json({"error": failure}, group)[0]["error"]  # 3: committed, or why not
    if failure is not None:
        raise StoreError(f"{store.uri(path)}: the optimizer state was not stored: {failure}")


def _upload(store: Any, writer: Any, path: str, scratch: Path, name: str) -> dict[str, Any]:
    """This rank's file put into the artifact (rank 0's through its writer): its manifest
    entry, for rank 0."""
    if writer is not None:
        writer.put_file(scratch / name, name)
        entry = writer.files[name]
    else:
        entry = store.put_part(path, scratch / name, name)
    return {"error": None, "file": name, "entry": {"size": entry.size, "sha256": entry.sha256}}


def _finish(writer: Any, reports: list[dict[str, Any]], stream: ShardStream, failure: str | None) -> str | None:
    """Rank 0: the other ranks' files, the index and the state's JSON added and the
    manifest written; or, after a failure anywhere, the artifact discarded."""

    def commit() -> None:
        for report in reports[1:]:
            writer.adopt(report["file"], FileEntry(**report["entry"]))
        writer.write_json(INDEX_FILE, shard_index(stream, [report["chunks"] for report in reports]))
        writer.write_bytes(RNG_FILE, stream.rng_file())
        writer.write_bytes(META_FILE, json.dumps(stream.meta, sort_keys=True).encode())

    try:
        if failure is not None:
            raise StoreError(failure)
        commit()
    except Exception as error:
        writer.__exit__(type(error), error, error.__traceback__)  # discards what was put
        return failure or _describe(error)
    return _attempt(lambda: writer.__exit__(None, None, None))


def _attempt(work: Callable[[], object]) -> str | None:
    """None when ``work`` succeeds, else what went wrong (sent to the other ranks)."""
    try:
        work()
    except Exception as error:
        return _describe(error)
    return None


def _attempt_report(work: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    try:
        return work()
    except Exception as error:
        return {"error": _describe(error)}


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"
