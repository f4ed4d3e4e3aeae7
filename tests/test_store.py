"""The artifact store, the same bodies against a local folder and a real S3 server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from helpers import trajectory_table

from drmas.algos import compute_advantages
from drmas.infra.layout import iteration_path, split_iteration_path
from drmas.infra.schema import TRAJECTORY_SCHEMA, SchemaError
from drmas.infra.store import (
    MANIFEST,
    ArtifactExists,
    ArtifactNotFound,
    CorruptArtifact,
    Store,
    StoreError,
)

ARTIFACT = iteration_path("exp", "run-1", 3) + "/rollout"


def test_iteration_layout():
    assert iteration_path("exp", "run-1", 3) == "exp/run-1/iter-000003"
    assert split_iteration_path("exp/run-1/iter-000003/optim/solver") == ("exp/run-1", 3, "optim/solver")
    assert split_iteration_path("exp/run-1/iter-000003") == ("exp/run-1", 3, "")
    assert split_iteration_path("exp/run-1/init/policy/solver") is None


def test_roundtrip_table_json_and_folder(store: Store, tmp_path):
    table = trajectory_table()
    policy = tmp_path / "policy"
    (policy / "tokenizer").mkdir(parents=True)
    (policy / "config.json").write_text('{"hidden_size": 8}')
    (policy / "tokenizer" / "vocab.json").write_text('{"a": 0}')
    with store.writer(ARTIFACT, meta={"stage": "rollout"}) as out:
        uri = out.write_table("trajectories.parquet", table, TRAJECTORY_SCHEMA)
        out.write_json("metrics.json", {"reward/mean": 0.5})
        out.put_dir(policy, "policy/solver")
    assert uri == f"{store.root}/{ARTIFACT}/trajectories.parquet"

    artifact = store.open(ARTIFACT)
    assert artifact.meta == {"stage": "rollout"}
    assert set(artifact.files) == {
        "trajectories.parquet",
        "metrics.json",
        "policy/solver/config.json",
        "policy/solver/tokenizer/vocab.json",
    }
    assert artifact.read_table("trajectories.parquet", TRAJECTORY_SCHEMA).equals(table)
    assert artifact.read_json("metrics.json") == {"reward/mean": 0.5}
    local = artifact.download(tmp_path / "down", prefix="policy/solver")
    assert (local / "tokenizer" / "vocab.json").read_text() == '{"a": 0}'
    assert store.list("exp") == [ARTIFACT]
    assert store.exists(ARTIFACT)


def test_dictionary_columns_feed_the_advantage_math(store: Store):
    """Keys read dictionary-encoded straight from Parquet go into compute_advantages."""
    table = trajectory_table(rows=12)
    with store.writer(ARTIFACT) as out:
        out.write_table("trajectories.parquet", table, TRAJECTORY_SCHEMA)
    keys = ["uid", "traj_uid", "agent"]
    read = store.open(ARTIFACT).read_table("trajectories.parquet", TRAJECTORY_SCHEMA, keys)
    assert pa.types.is_dictionary(read.schema.field("uid").type)
    score = read["reward"].to_numpy()
    from_arrow = compute_advantages(score, *(read[k] for k in keys), mode="drmas")
    from_numpy = compute_advantages(score, *(table[k].to_numpy() for k in keys), mode="drmas")
    np.testing.assert_array_equal(from_arrow, from_numpy)


def test_complete_artifact_is_not_overwritten_unless_forced(store: Store):
    with store.writer(ARTIFACT) as out:
        out.write_bytes("old.txt", b"old")
        out.write_bytes("keep-name.txt", b"v1")
    with pytest.raises(ArtifactExists, match="refusing to overwrite"):
        with store.writer(ARTIFACT) as out:
            out.write_bytes("keep-name.txt", b"v2")
    assert store.open(ARTIFACT).read_bytes("keep-name.txt") == b"v1"

    with store.writer(ARTIFACT, overwrite=True) as out:
        out.write_bytes("keep-name.txt", b"v2")
    artifact = store.open(ARTIFACT)
    assert set(artifact.files) == {"keep-name.txt"}
    assert artifact.read_bytes("keep-name.txt") == b"v2"
    old_file = store._abs(ARTIFACT, "old.txt")
    assert store.fs.get_file_info(old_file).type.name == "NotFound"


def test_failed_writer_leaves_nothing_visible(store: Store):
    with pytest.raises(RuntimeError, match="stage failed"):
        with store.writer(ARTIFACT) as out:
            out.write_bytes("part.bin", b"x" * 100)
            raise RuntimeError("stage failed")
    assert not store.exists(ARTIFACT)
    assert store.list() == []
    with pytest.raises(ArtifactNotFound, match="no complete artifact"):
        store.open(ARTIFACT)


KILLED_WRITER = textwrap.dedent(
    """
    import sys, time
    import pyarrow as pa
    from drmas.infra.store import Store
    store = Store(sys.argv[1], sys.argv[2] or None)
    with store.writer(sys.argv[3]) as out:
        out.write_table("trajectories.parquet", pa.table({"x": list(range(1000))}))
        print("first file written", flush=True)
        time.sleep(120)
        out.write_bytes("second.bin", b"never")
    """
)


def test_writer_killed_mid_way_leaves_nothing_a_reader_sees(store: Store):
    process = subprocess.Popen(
        [sys.executable, "-c", KILLED_WRITER, store.root, store.endpoint or "", ARTIFACT],
        stdout=subprocess.PIPE,
        text=True,
        env=os.environ.copy(),
    )
    try:
        assert process.stdout.readline().strip() == "first file written"
        os.kill(process.pid, signal.SIGKILL)
    finally:
        process.wait(timeout=30)
    assert process.returncode == -signal.SIGKILL
    leftover = store._abs(ARTIFACT, "trajectories.parquet")
    assert store.fs.get_file_info(leftover).type.name == "File"  # the kill really was mid-way
    assert not store.exists(ARTIFACT)
    assert store.list() == []
    with pytest.raises(ArtifactNotFound):
        store.open(ARTIFACT)

    with store.writer(ARTIFACT) as out:  # a rerun of the stage replaces the leftovers
        out.write_bytes("result.txt", b"done")
    assert set(store.open(ARTIFACT).files) == {"result.txt"}


def _rewrite(store: Store, name: str, data: bytes) -> None:
    with store.fs.open_output_stream(store._abs(ARTIFACT, name)) as stream:
        stream.write(data)


def test_truncated_parquet_is_refused_with_path_and_reason(store: Store):
    with store.writer(ARTIFACT) as out:
        out.write_table("trajectories.parquet", trajectory_table(), TRAJECTORY_SCHEMA)
    data = store.open(ARTIFACT).read_bytes("trajectories.parquet")
    _rewrite(store, "trajectories.parquet", data[: len(data) // 2])
    with pytest.raises(CorruptArtifact, match=r"trajectories\.parquet: \d+ bytes, but the manifest"):
        store.open(ARTIFACT).read_table("trajectories.parquet")


def test_modified_file_fails_its_hash(store: Store):
    with store.writer(ARTIFACT) as out:
        out.write_bytes("weights.bin", b"\x00" * 64)
    _rewrite(store, "weights.bin", b"\x01" * 64)
    with pytest.raises(CorruptArtifact, match=r"weights\.bin: sha256 differs"):
        store.open(ARTIFACT).read_bytes("weights.bin")


def test_sizes_are_checked_without_reading(store: Store):
    """``check_sizes``: every file there at its manifest's size, or the file named; a file
    of the right size but other bytes passes (its sha256 is checked when it is read)."""
    with store.writer(ARTIFACT) as out:
        out.write_bytes("optimizer.safetensors", b"\x00" * 64)
        out.write_bytes("state.json", b"{}")
    store.open(ARTIFACT).check_sizes()
    _rewrite(store, "optimizer.safetensors", b"\x01" * 64)
    store.open(ARTIFACT).check_sizes()
    _rewrite(store, "optimizer.safetensors", b"\x00" * 10)
    with pytest.raises(CorruptArtifact, match=r"optimizer\.safetensors: 10 bytes, but the manifest says 64"):
        store.open(ARTIFACT).check_sizes()
    _rewrite(store, "optimizer.safetensors", b"\x00" * 64)
    store.fs.delete_file(store._abs(ARTIFACT, "state.json"))
    with pytest.raises(CorruptArtifact, match=r"state\.json: listed in the manifest but missing"):
        store.open(ARTIFACT).check_sizes()


def test_damaged_manifests_are_refused(store: Store):
    with store.writer(ARTIFACT) as out:
        out.write_bytes("a.txt", b"a")
    _rewrite(store, MANIFEST, b"{not json")
    with pytest.raises(CorruptArtifact, match=r"_MANIFEST\.json: unreadable manifest"):
        store.open(ARTIFACT)
    escaping = {"format": "drmas.artifact/1", "files": {"../../x": {"size": 1, "sha256": "0"}}}
    _rewrite(store, MANIFEST, json.dumps(escaping).encode())
    with pytest.raises(StoreError, match=r"may not contain '\.\.'"):
        store.open(ARTIFACT)


def test_schema_is_checked_on_write_and_on_read(store: Store):
    table = trajectory_table()
    broken = table.drop_columns(["traj_uid"]).set_column(
        table.schema.get_field_index("reward") - 1, "reward", pc.cast(table["reward"], pa.string())
    )
    with pytest.raises(SchemaError) as error:
        with store.writer(ARTIFACT) as out:
            out.write_table("trajectories.parquet", broken, TRAJECTORY_SCHEMA)
    message = str(error.value)
    assert "trajectories.parquet" in message
    assert "column 'traj_uid' is missing" in message
    assert "column 'reward' has type string, expected float" in message
    assert not store.exists(ARTIFACT)

    with store.writer(ARTIFACT) as out:  # written without a schema, read with one
        out.write_table("trajectories.parquet", broken)
    with pytest.raises(SchemaError, match="column 'traj_uid' is missing"):
        store.open(ARTIFACT).read_table("trajectories.parquet", TRAJECTORY_SCHEMA)


def test_nulls_are_refused_by_the_schema(store: Store):
    table = trajectory_table()
    index = table.schema.get_field_index("agent")
    with_null = table.set_column(index, "agent", pa.array([None] + ["solver"] * 5, pa.string()))
    with pytest.raises(SchemaError, match="column 'agent' has 1 null"):
        with store.writer(ARTIFACT) as out:
            out.write_table("trajectories.parquet", with_null, TRAJECTORY_SCHEMA)


def test_missing_file_named_in_error(store: Store):
    with store.writer(ARTIFACT) as out:
        out.write_bytes("a.txt", b"a")
    with pytest.raises(CorruptArtifact, match="has no file 'b.txt'"):
        store.open(ARTIFACT).read_bytes("b.txt")


# ------------------------------------------------------------------------------------
# S3 failures: a clear error, quickly, with no secret in it
# ------------------------------------------------------------------------------------


def _fails_fast(expected: str, *args) -> str:
    started = time.monotonic()
    with pytest.raises(StoreError, match=expected) as error:
        Store(*args)
    assert time.monotonic() - started < 15
    return str(error.value)


def test_wrong_credentials(s3_env, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret-" + "x" * 20)
    message = _fails_fast("denied access.*AWS_ACCESS_KEY_ID", "s3://drmas-test/x", s3_env.endpoint)
    assert "not-the-secret" not in message and s3_env.secret_key not in message


def test_missing_bucket(s3_env):
    _fails_fast("bucket 'no-such-bucket' does not exist", "s3://no-such-bucket/x", s3_env.endpoint)


def test_unreachable_endpoint(s3_env):
    _fails_fast("cannot reach the S3 endpoint http://127.0.0.1:9", "s3://drmas-test/x", "http://127.0.0.1:9")


def test_endpoint_from_environment(s3_env, monkeypatch):
    monkeypatch.setenv("DRMAS_S3_ENDPOINT", s3_env.endpoint)
    store = Store("s3://drmas-test/from-env")
    assert store.endpoint == s3_env.endpoint
    with store.writer("a") as out:
        out.write_bytes("x", b"1")
    assert store.open("a").read_bytes("x") == b"1"


def test_invalid_root():
    with pytest.raises(StoreError, match="not s3://bucket"):
        Store("s3://UPPER_case/x", "http://127.0.0.1:9")
