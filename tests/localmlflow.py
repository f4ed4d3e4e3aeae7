"""A real MLflow tracking server for the tests: ``mlflow server`` (sqlite backend, artifacts
served through it) on 127.0.0.1, in its own process group so that it can be killed (-9)
and started again on the same port and database. The session's one is the conftest
fixture ``mlflow_server``."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

MLFLOW = Path(sys.executable).parent / "mlflow"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


SERVER_ENV = {"MLFLOW_DISABLE_TELEMETRY": "true", "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
"""As ``make ui`` and the cluster's server run it: without MLflow 3's job runner, nine
processes (its GenAI scorers and trace jobs, which drmas never uses) that took ~30 s of CPU
at each start, a third of the suite's MLflow cost."""


class MlflowServer:
    """``mlflow server`` on 127.0.0.1:``port`` over ``folder/mlflow.db``; it can be killed
    (-9) and started again on the same port and database."""

    def __init__(self, folder: Path, args: tuple[str, ...] = (), env: dict[str, str] | None = None) -> None:
        """``args``: more arguments of ``mlflow server`` (``--app-name=basic-auth``, say);
        ``env``: more environment for it (the auth app's settings and admin account)."""
        self.folder = folder
        self.port = _free_port()
        self.args = args
        self.env = env or {}
        self.process: subprocess.Popen[bytes] | None = None
        folder.mkdir(parents=True, exist_ok=True)

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def database(self) -> str:
        return f"sqlite:///{self.folder / 'mlflow.db'}"

    def start(self, timeout_s: float = 90.0) -> MlflowServer:
        command = [
            str(MLFLOW),
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--workers",
            "1",
            "--backend-store-uri",
            self.database,
            "--artifacts-destination",
            str(self.folder / "artifacts"),
            *self.args,
        ]
        with open(self.folder / "server.log", "ab") as log:
            self.process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, **SERVER_ENV, **self.env},
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.process.poll() is None, (self.folder / "server.log").read_text()[-2000:]
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as reply:
                    if reply.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                time.sleep(0.3)
        raise TimeoutError(f"mlflow server did not answer /health in {timeout_s} s")

    def kill(self) -> None:
        """SIGKILL to the server's process group (the server and its workers: nothing else);
        returns once its port refuses connections (a worker may outlive the server briefly)."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self.process = None
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
            except ConnectionRefusedError:
                return
            except OSError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"port {self.port} still answers 30 s after the server was killed")
