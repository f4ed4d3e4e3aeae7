"""Shared fixtures: a real S3 server (SeaweedFS on 127.0.0.1), a store on each backend, a
real MLflow server, a local Ray, and two real trained runs that several modules read (each
copies one before it changes anything): one on S3 (``trained_run``), and the uninterrupted
run that the kill and resume tests compare with (``baseline_run``). Then the tiers and the
scheduling of test files on xdist workers.

The server is started once per test session by this fixture and stopped by its PID; its
credentials are random, so tests can also check that they never leak into messages.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

import pyarrow.fs as pafs
import pytest
from helpers import ROOT, TINY_OVERRIDES
from localmlflow import MlflowServer
from locals3 import DiskTooFull, LocalS3Server

from drmas.infra.store import Store

S3_BUCKET = "drmas-test"
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never download from the hub


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory):
    server = LocalS3Server(
        tmp_path_factory.mktemp("seaweedfs"),
        access_key=f"drmas-{secrets.token_hex(4)}",
        secret_key=secrets.token_hex(16),
        buckets=(S3_BUCKET,),
    )
    server.start()
    yield server
    server.stop()


@pytest.fixture
def s3_env(s3_server: LocalS3Server, monkeypatch: pytest.MonkeyPatch) -> LocalS3Server:
    """The server, with its credentials in the environment as a user would set them; a
    test fails at once, saying why, when the disk is too full for the server to write."""
    try:
        s3_server.check_disk()
    except DiskTooFull as full:
        pytest.fail(str(full), pytrace=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret_key)
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    return s3_server


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path) -> Store:
    """The same test body runs against a local folder and against the real S3 server."""
    if request.param == "local":
        return Store(str(tmp_path / "store"))
    server = request.getfixturevalue("s3_env")
    return Store(f"s3://{S3_BUCKET}/{uuid.uuid4().hex}", server.endpoint)


@pytest.fixture(scope="session")
def mlflow_service(tmp_path_factory: pytest.TempPathFactory):
    """One MLflow server for the session (each start costs 10-30 s here); killed at the end."""
    server = MlflowServer(tmp_path_factory.mktemp("mlflow"))
    yield server
    server.kill()


@pytest.fixture
def mlflow_server(mlflow_service: MlflowServer) -> MlflowServer:
    """The session's MLflow server, running: started again when a test before killed it."""
    return mlflow_service if mlflow_service.process is not None else mlflow_service.start()


@pytest.fixture(scope="module")
def local_ray(tmp_path_factory: pytest.TempPathFactory):
    """A local Ray for the test file (pool resource 'pool_slot'), shut down after its last
    test: an idle local Ray takes ~5% of a core (its raylet, GCS, agents and idle workers),
    which over a whole session on two cores was a minute of CPU."""
    from drmas.config import DrmasConfig
    from drmas.generation.ray_session import ray_session

    config = DrmasConfig.model_validate(
        {"agents": [{"name": "solver", "model": "m"}, {"name": "verifier", "model": "m"}]}
    )
    with ray_session(config, tmp_path_factory.mktemp("ray")):
        yield


@pytest.fixture
def warm_start_prompts(monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """The prompt token ids of every row the warm start trains on in this process, in order,
    recorded as its batches are collated (the test may clear the list between runs)."""
    from drmas.stages import warmstart

    recorded: list[list[int]] = []
    real_collate = warmstart.collate

    def recording_collate(rows, pad_id):
        recorded.extend(row["prompt_ids"] for row in rows)
        return real_collate(rows, pad_id)

    monkeypatch.setattr(warmstart, "collate", recording_collate)
    return recorded


TRAINED_RUN = "secret-scan-run"
TRAINED_SETTINGS = [*TINY_OVERRIDES, "eval.every=0"]
"""The run id and the settings of ``trained_run`` (a resume of it must repeat them)."""


@dataclass
class TrainedRun:
    """A one-iteration run of ``configs/math_tiny.yaml`` that ``drmas run`` trained."""

    root: str
    """Its store root on the S3 server."""
    endpoint: str
    folder: Path
    """The working folder of the run (its MLflow database and caches)."""
    ray_dir: Path
    output: str
    secrets: dict[str, str]
    """The credentials and token that were in its environment, by variable."""


@pytest.fixture(scope="session")
def trained_run(s3_server: LocalS3Server, tmp_path_factory: pytest.TempPathFactory):
    """``drmas run`` for one iteration (warm start, Ray, tiny models) on the real S3
    server, its credentials and an MLflow token in the environment, Ray's session folder
    kept where it can be read: trained once for the session (about 35 s) and read by
    test_security.py (which scans it for the secrets) and test_bad_input.py (which damages
    copies of it). Never change it in place: copy it with ``copy_trained_run`` first."""
    folder = tmp_path_factory.mktemp("trained-run")
    ray_dir = Path(tempfile.mkdtemp(prefix="drmas-sec-"))  # short: Ray's socket paths
    planted = {
        "AWS_ACCESS_KEY_ID": s3_server.access_key,
        "AWS_SECRET_ACCESS_KEY": s3_server.secret_key,
        "MLFLOW_TRACKING_TOKEN": f"mlflow-token-{secrets.token_hex(12)}",
    }
    root = f"s3://{S3_BUCKET}/{uuid.uuid4().hex}"
    env = {key: value for key, value in os.environ.items() if key != "AWS_SESSION_TOKEN"}
    env |= planted | {"HF_HUB_OFFLINE": "1", "RAY_TMPDIR": str(ray_dir)}
    command = [
        str(Path(sys.executable).parent / "drmas"),
        "run",
        str(ROOT / "configs" / "math_tiny.yaml"),
        *TRAINED_SETTINGS,
        "experiment.iterations=1",
        f"store.root={root}",
        f"store.endpoint={s3_server.endpoint}",
        "--run-id",
        TRAINED_RUN,
    ]
    done = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    yield TrainedRun(root, s3_server.endpoint, folder, ray_dir, done.stdout + done.stderr, planted)
    shutil.rmtree(ray_dir, ignore_errors=True)


def copy_trained_run(run: TrainedRun, destination: str) -> None:
    """Copy the trained run's store to ``destination``: a local folder or another
    ``s3://`` root on the same server (a moved store is the same run)."""
    s3 = pafs.S3FileSystem(
        endpoint_override=run.endpoint.removeprefix("http://"),
        scheme="http",
        region="us-east-1",
        access_key=run.secrets["AWS_ACCESS_KEY_ID"],
        secret_key=run.secrets["AWS_SECRET_ACCESS_KEY"],
    )
    if destination.startswith("s3://"):
        target_fs, target = s3, destination.removeprefix("s3://")
    else:
        target_fs, target = pafs.LocalFileSystem(), str(Path(destination).resolve())
    pafs.copy_files(run.root.removeprefix("s3://"), target, source_filesystem=s3, destination_filesystem=target_fs)


@pytest.fixture(scope="session")
def local_trained_run(trained_run: TrainedRun, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The trained run copied from S3 to a local store root, once: run ``TRAINED_RUN`` is
    in it. Copy this folder too before changing anything in it."""
    root = tmp_path_factory.mktemp("trained-local") / "runs"
    copy_trained_run(trained_run, str(root))
    return root


BASELINE_RUN = "uninterrupted"
BASELINE_SETTINGS = [*TINY_OVERRIDES, "experiment.iterations=2", "eval.every=1", "eval.max_questions=3", "eval.k=2"]
"""The run id and the settings of ``baseline_run``: a run that is killed and resumed with these
settings must end where it ends."""


@dataclass
class BaselineRun:
    """An uninterrupted ``drmas run`` of ``configs/math_tiny.yaml`` with ``BASELINE_SETTINGS``."""

    folder: Path
    """Its working folder (the run's ``.cache`` is there)."""
    root: Path
    """Its local store root: the run, and MLflow's database and artifacts beside it."""
    output: str


@pytest.fixture(scope="session")
def baseline_run(tmp_path_factory: pytest.TempPathFactory) -> BaselineRun:
    """The run that test_kills.py and test_resume.py compare their killed and resumed runs
    with, byte for byte: trained once for the session (about 40 s; the two files run on one
    xdist worker, ``SHARED_SESSION_FIXTURE``). Never change it: copy its ``root`` first."""
    folder = tmp_path_factory.mktemp("baseline-run")
    command = [
        str(Path(sys.executable).parent / "drmas"),
        "run",
        str(ROOT / "configs" / "math_tiny.yaml"),
        *BASELINE_SETTINGS,
        f"store.root={folder / 'runs'}",
        "--run-id",
        BASELINE_RUN,
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return BaselineRun(folder, folder / "runs", done.stdout)


RUNS_A_TRAINED_RUN = {"trained_run", "local_trained_run", "baseline_run"}
"""Fixtures that train with ``drmas run``: a test that uses one is an end-to-end test."""


# --------------------------------------------------------------------------------------
# Tiers and scheduling on pytest-xdist workers (`make test`: --dist loadfile --no-loadscope-reorder)
# --------------------------------------------------------------------------------------

SHARED_SESSION_FIXTURE = dict.fromkeys(("test_disk_full", "test_bad_input", "test_security"), "trained_run") | {
    "test_kills": "baseline_run",
    "test_resume": "baseline_run",
}
"""Test files that use one costly session fixture (``trained_run``, ``baseline_run``: a ``drmas
run`` each, 30-45 s): xdist hands them to one worker as one unit, so that the fixture is
built once, not once per worker that runs one of them."""
SECONDS_ON_A_WORKER = {
    "test_real_model": 280,
    "test_pipelines": 265,
    "test_kills": 250,  # with test_resume: one unit (the baseline run)
    "test_resume": 250,
    "test_rollout": 185,
    "test_store_faults": 170,
    "test_disk_full": 135,  # with test_bad_input and test_security: one unit (the trained run)
    "test_bad_input": 135,
    "test_security": 135,
    "test_update": 135,
    "test_pool_cluster": 110,
    "test_compare": 90,
    "test_grad_norms": 65,
    "test_tracking_faults": 60,
    "test_manifests": 50,
    "test_deepspeed_bf16": 40,
}
"""What each unit of test files took on one of two workers (measured; the rest take under
40 s each). xdist hands a worker a whole unit at a time, in collection order: the longest
go first, so that the workers finish together (by default it orders them by their number of
tests, which leaves the files of one long test to the end)."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test that reads a trained run is marked e2e (a tier can be deselected whole, with
    its session fixture's run); on xdist workers, the longest units first (a stable sort:
    collection order within)."""
    for item in items:
        if RUNS_A_TRAINED_RUN & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.e2e)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=lambda item: -SECONDS_ON_A_WORKER.get(item.path.stem, 0))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """``--dist loadfile``, with the files of ``SHARED_SESSION_FIXTURE`` as one unit.

    (xdist's own ``loadgroup`` would do it by marks, but it renames the tests it groups,
    which pytest 9 no longer takes into account.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling  # only under xdist (`make test`)

    class SharedFixtureScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file = super()._split_scope(nodeid)
            return SHARED_SESSION_FIXTURE.get(Path(file).stem, file)

    return SharedFixtureScheduling(config, log)
