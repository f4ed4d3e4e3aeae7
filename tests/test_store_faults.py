"""The S3 store under faults: a fault-injecting proxy (tests/faultproxy.py) sits between
the store and the real SeaweedFS server and answers 500/503, drops connections (before the
request is applied, or after, losing only the reply), stalls, or cuts and stalls replies
mid-body, each on a seeded fraction of requests.

What must hold: every write and read completes through retries, every artifact reads back
byte for byte, and the bucket holds exactly the objects written (nothing lost, nothing
duplicated, no stray leftovers); a store that stays down fails the operation with a
StoreError naming the endpoint within a bounded time, and leaves nothing visible.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pyarrow.fs as pafs
import pytest
from conftest import S3_BUCKET
from faultproxy import FAULTS, FaultProxy
from helpers import TINY_OVERRIDES, trajectory_table
from locals3 import LocalS3Server

from drmas.infra.schema import TRAJECTORY_SCHEMA
from drmas.infra.store import MANIFEST, Store, StoreError

REQUEST_TIMEOUT_S = 1
"""The client's request timeout in these tests (the proxy stalls for 1.5 s): a stall then
costs a second or two per request instead of the default 30."""
RETRY_WINDOW_S = 30
"""How long an operation is retried while the proxy injects faults on some requests."""
DOWN_RETRY_WINDOW_S = 4
DOWN_BOUND_S = 30
"""With a retry window of DOWN_RETRY_WINDOW_S, a store that stays down must fail an
operation within DOWN_BOUND_S seconds."""
ROOT = Path(__file__).parent.parent


@pytest.fixture
def proxy(s3_env: LocalS3Server, monkeypatch: pytest.MonkeyPatch):
    """A fault-free proxy to the S3 server (tests turn faults on), with short timeouts."""
    monkeypatch.setenv("DRMAS_S3_REQUEST_TIMEOUT_S", str(REQUEST_TIMEOUT_S))
    monkeypatch.setenv("DRMAS_S3_RETRY_S", str(RETRY_WINDOW_S))
    with FaultProxy(s3_env.endpoint, seed=8, stall_s=1.5 * REQUEST_TIMEOUT_S) as running:
        yield running


def proxied_store(proxy: FaultProxy) -> Store:
    """A store under a fresh prefix, opened while the proxy is still fault-free."""
    return Store(f"s3://{S3_BUCKET}/{uuid.uuid4().hex}", proxy.endpoint)


def artifact_files(index: int) -> dict[str, bytes]:
    """One artifact's plain files, seeded: a JSON file and a folder of about 300 KB (a
    policy's weights, say); each artifact also holds ``trajectories.parquet``."""
    rng = np.random.default_rng(index)
    folder = {f"policy/part-{part}.bin": rng.bytes(int(rng.integers(100_000, 200_000))) for part in range(2)}
    return {"metrics.json": f'{{"reward": {index}}}'.encode(), **folder}


def write_artifacts(store: Store, count: int) -> dict[str, dict[str, bytes]]:
    """Write ``count`` artifacts; the plain files each should hold, by path."""
    written = {}
    for index in range(count):
        path = f"exp/run/iter-{index:06d}/stage"
        files = artifact_files(index)
        with store.writer(path, meta={"index": index}) as out:
            out.write_table("trajectories.parquet", trajectory_table(seed=index), TRAJECTORY_SCHEMA)
            for name, data in files.items():
                out.write_bytes(name, data)
        written[path] = files
    return written


def assert_exactly(store: Store, written: dict[str, dict[str, bytes]]) -> None:
    """The store lists exactly these artifacts; each holds these files with these bytes
    (and its table, where it has one), all verified against its manifest; and the bucket
    holds no other object under the store's prefix (no duplicate, no leftover)."""
    assert store.list() == sorted(written)
    expected_objects = set()
    for path, files in written.items():
        artifact = store.open(path)
        for name, data in files.items():
            assert artifact.read_bytes(name) == data, f"{path}/{name}"
        if "trajectories.parquet" in artifact.files:
            index = artifact.meta["index"]
            assert artifact.read_table("trajectories.parquet", TRAJECTORY_SCHEMA).equals(trajectory_table(seed=index))
        assert set(artifact.files) - set(files) <= {"trajectories.parquet"}
        expected_objects |= {f"{path}/{name}" for name in [*artifact.files, MANIFEST]}
    found = store.fs.get_file_info(pafs.FileSelector(store.base, recursive=True))
    objects = {info.path[len(store.base) + 1 :] for info in found if info.type == pafs.FileType.File}
    assert objects == expected_objects


@pytest.mark.parametrize(
    "fault", [pytest.param(f, marks=pytest.mark.slow) if f.startswith("stall") else f for f in FAULTS]
)
def test_every_fault_is_retried_and_nothing_is_lost(proxy: FaultProxy, fault: str, capsys):
    """One fault type on a fifth of the requests (stalls, which cost a timeout each, on a
    tenth): two artifacts written, one overwritten, all read back through the faults."""
    store = proxied_store(proxy)
    proxy.set_faults({fault: 0.1 if fault.startswith("stall") else 0.2})
    started = time.monotonic()
    written = write_artifacts(store, 2)
    first = next(iter(written))
    with store.writer(first, overwrite=True) as out:
        out.write_bytes("replaced.txt", b"second version")
    written[first] = {"replaced.txt": b"second version"}
    assert_exactly(store, written)
    elapsed = time.monotonic() - started
    with capsys.disabled():
        print(f"\n{fault}: {proxy.injected[fault]} of {proxy.requests} requests faulted, all held, {elapsed:.1f} s")
    assert proxy.injected[fault] > 0


@pytest.mark.slow
def test_mixed_faults_on_a_third_of_requests(proxy: FaultProxy, capsys):
    """Every fault type at once, on 30% of the requests (each stall type on 2.5%, each
    other type on 5%): four artifacts, one deleted."""
    store = proxied_store(proxy)
    proxy.set_faults({fault: 0.025 if fault.startswith("stall") else 0.05 for fault in FAULTS})
    started = time.monotonic()
    written = write_artifacts(store, 4)
    deleted = sorted(written)[1]
    store.delete(deleted)
    del written[deleted]
    assert_exactly(store, written)
    with capsys.disabled():
        faulted = sum(proxy.injected.values())
        print(
            f"\nmixed: {faulted} of {proxy.requests} requests faulted ({dict(proxy.injected)}), "
            f"all held, {time.monotonic() - started:.1f} s"
        )
    assert all(proxy.injected[fault] > 0 for fault in FAULTS)


DOWN = {
    "503 always": lambda proxy: proxy.set_faults({"error503": 1.0}),
    "stalls always": lambda proxy: proxy.set_faults({"stall": 1.0}),
    "refuses connections": FaultProxy.stop,
}


@pytest.mark.slow
@pytest.mark.parametrize("outage", DOWN)
def test_store_that_stays_down_fails_within_a_bound(
    proxy: FaultProxy, s3_env: LocalS3Server, outage: str, monkeypatch: pytest.MonkeyPatch
):
    """A stage writing or reading while the store is down gets a StoreError naming the
    endpoint, after retrying for the window but within the bound, and leaves no artifact."""
    monkeypatch.setenv("DRMAS_S3_RETRY_S", str(DOWN_RETRY_WINDOW_S))
    store = proxied_store(proxy)
    with store.writer("done") as out:
        out.write_bytes("a.txt", b"complete before the outage")
    DOWN[outage](proxy)

    started = time.monotonic()
    with pytest.raises(StoreError) as error:
        with store.writer("during") as out:
            out.write_bytes("b.txt", b"never complete")
    elapsed = time.monotonic() - started
    assert proxy.endpoint in str(error.value) and "gave up after" in str(error.value)
    assert DOWN_RETRY_WINDOW_S / 2 < elapsed < DOWN_BOUND_S, elapsed

    started = time.monotonic()
    with pytest.raises(StoreError, match="gave up after"):
        store.open("done").read_bytes("a.txt")
    assert time.monotonic() - started < DOWN_BOUND_S

    direct = Store(store.root, s3_env.endpoint)
    assert direct.list() == ["done"] and direct.open("done").read_bytes("a.txt") == b"complete before the outage"


@pytest.mark.slow
def test_store_opened_while_down_fails_within_a_bound(proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("DRMAS_S3_RETRY_S", str(DOWN_RETRY_WINDOW_S))
    proxy.set_faults({"error503": 1.0})
    started = time.monotonic()
    with pytest.raises(StoreError, match=f"S3 error at {proxy.endpoint}.*gave up after"):
        proxied_store(proxy)
    assert time.monotonic() - started < DOWN_BOUND_S


E2E_FAULTS = {
    "error500": 0.02,
    "error503": 0.02,
    "drop_request": 0.02,
    "drop_reply": 0.02,
    "cut_reply": 0.015,
    "stall": 0.005,
}
"""About 10% of requests: dozens of faults in a run of several hundred requests."""
STAGES = (
    "rollout",
    "advantage",
    "policy/solver",
    "policy/verifier",
    "optim/solver",
    "optim/verifier",
    "evaluate",
    "checkpoint",
)


def drmas_run_on_s3(tmp_path: Path, root: str, endpoint: str, run_id: str) -> subprocess.CompletedProcess[str]:
    """One iteration of the tiny math config through ``drmas run`` (evaluated before and
    after), its store on S3."""
    command = [
        str(Path(sys.executable).parent / "drmas"),
        "run",
        str(ROOT / "configs" / "math_tiny.yaml"),
        *TINY_OVERRIDES,
        "warmstart.steps=0",
        "experiment.iterations=1",
        "eval.every=1",
        "eval.max_questions=2",
        "eval.k=2",
        f"store.root={root}",
        f"store.endpoint={endpoint}",
        "--run-id",
        run_id,
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "DRMAS_S3_REQUEST_TIMEOUT_S": "2", "DRMAS_S3_RETRY_S": "60"}
    return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def final_policies(store: Store, run_id: str) -> dict[str, bytes]:
    return {
        wg: store.open(f"math-tiny/{run_id}/iter-000000/policy/{wg}").read_bytes("model.safetensors")
        for wg in ("solver", "verifier")
    }


@pytest.mark.slow
@pytest.mark.e2e
def test_drmas_run_through_a_faulty_store(proxy: FaultProxy, s3_env: LocalS3Server, tmp_path: Path, capsys):
    """A real run whose every store access (driver and Ray workers) goes through the faulty
    proxy completes; every artifact it wrote verifies against its manifest; and its final
    policies are the bytes of the same run against the store directly."""
    root = f"s3://{S3_BUCKET}/{uuid.uuid4().hex}"
    proxy.stall_s = 4  # the run's requests time out after 2 s of silence (a loaded machine is slower)
    proxy.set_faults(E2E_FAULTS)
    started = time.monotonic()
    faulty = drmas_run_on_s3(tmp_path, root, proxy.endpoint, "faulty")
    elapsed = time.monotonic() - started
    assert faulty.returncode == 0, faulty.stdout + faulty.stderr
    assert "iter 0:" in faulty.stdout

    store = Store(root, s3_env.endpoint)
    artifacts = store.list("math-tiny/faulty")
    assert {f"math-tiny/faulty/iter-000000/{stage}" for stage in STAGES} | {"math-tiny/faulty/init/evaluate"} <= set(
        artifacts
    )
    for path in artifacts:
        artifact = store.open(path)
        for name in artifact.files:
            artifact.read_bytes(name)  # refused if its size or sha256 differs from the manifest
    faulted = sum(proxy.injected.values())
    with capsys.disabled():
        print(
            f"\ndrmas run through the proxy: {faulted} of {proxy.requests} requests faulted ({dict(proxy.injected)}), "
            f"{len(artifacts)} artifacts verified, {elapsed:.1f} s"
        )
    assert faulted > 0

    clean = drmas_run_on_s3(tmp_path, root, s3_env.endpoint, "clean")
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert final_policies(store, "faulty") == final_policies(store, "clean")


def test_a_disk_too_full_for_the_s3_server_is_named_before_a_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """SeaweedFS turns read-only below 1% of its disk free; the test server says so, naming
    the folder, instead of leaving each write to fail as an S3 internal error."""
    import shutil

    import locals3

    server = LocalS3Server(tmp_path, access_key="k", secret_key="s")
    total = 100 * 2**30
    monkeypatch.setattr(locals3.shutil, "disk_usage", lambda _: shutil._ntuple_diskusage(total, total, 2 * 2**30))
    server.check_disk()  # 2 GiB free: above the 1 GiB floor and the margin
    monkeypatch.setattr(locals3.shutil, "disk_usage", lambda _: shutil._ntuple_diskusage(total, total, 2**30))
    with pytest.raises(locals3.DiskTooFull, match=rf"{tmp_path}.*1\.00 GiB free.*below 1% of it \(1\.00 GiB\)"):
        server.check_disk()
