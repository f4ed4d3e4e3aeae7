"""Shared fixtures: a real S3 server (SeaweedFS on 127.0.0.1) and a store on each backend.

The server is started once per test session by this fixture and stopped by its PID; its
credentials are random, so tests can also check that they never leak into messages.
"""

from __future__ import annotations

import os
import secrets
import uuid

import pytest
from locals3 import LocalS3Server

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
    """The server, with its credentials in the environment as a user would set them."""
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
def ray_session(tmp_path_factory: pytest.TempPathFactory):
    """A local Ray for the whole session (pool resource 'pool_slot'), shut down at the end."""
    import ray

    from drmas.config import DrmasConfig
    from drmas.generation.pool import connect_ray

    config = DrmasConfig.model_validate(
        {"agents": [{"name": "solver", "model": "m"}, {"name": "verifier", "model": "m"}]}
    )
    started = connect_ray(config, tmp_path_factory.mktemp("ray"))
    yield
    if started:
        ray.shutdown()
