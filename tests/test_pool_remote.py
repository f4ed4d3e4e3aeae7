"""``drmas pool status|down`` as an operator runs it from outside the cluster (issue 29 §7):
Ray Client (``ray://``) through a port-forward of the head's port 10001, with the cluster's
token, against a real token-protected Ray head started here (one per module: ~6 s).

The head is ``ray start --head`` with ``RAY_AUTH_MODE=token`` and a random token, on
127.0.0.1 with ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``: with that variable at 1 (Ray's
default on Linux) Ray replaces ``--node-ip-address=127.0.0.1`` by the host's own address
(``resolve_ip_for_localhost``: 192.0.2.2 on these machines), to which a driver given
127.0.0.1 then connects in vain for minutes. It is stopped by PID (its process group).

Stand-ins, and what only a cluster shows: the port-forward is ``PortForward`` below, a TCP
relay on 127.0.0.1 (``kubectl port-forward`` relays the same bytes through the API server
to the head pod; that kubectl keeps a long gRPC stream open, and the API server's own
authorization, are not shown here). The run's pool is made of stand-in workers (named,
detached actors with the workers' ``status()``), its real lease and its real named
placement group: the CLI finds, lists and frees them by name as it does a real run's. Not
tested: KubeRay's injection of the token into the head, TLS (``RAY_USE_TLS``), and a client
whose Python or Ray version differs from the cluster's (Ray Client refuses it; ``drmas
pool`` passes Ray's message on).
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import ROOT, drmas, free_port

pytestmark = pytest.mark.slow

AUTH_VARIABLES = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS")

STAND_IN_POOLS = r"""
import os, sys
import ray
from ray.util.placement_group import placement_group
from drmas.generation.named_pool import NAMESPACE, pool_lease, pool_name, worker_name

ray.init(address=sys.argv[1], log_to_driver=False, configure_logging=False)

@ray.remote(num_cpus=0)
class StandInWorker:
    # What `drmas pool status` asks a pool worker (generation.workers.PoolWorker.status).
    def __init__(self, rank):
        self.rank = rank

    def status(self):
        return {"version": "iter-000003", "resident": True, "rank": self.rank, "world": 2, "pid": os.getpid()}

for run in sys.argv[2:]:
    prefix = pool_name(*run.split("/"))
    group = placement_group([{"pool_slot": 0.25}], name=prefix, lifetime="detached")
    ray.get(group.ready(), timeout=60)
    for slot in range(2):
        StandInWorker.options(
            name=worker_name(prefix, "solver", slot), namespace=NAMESPACE, lifetime="detached"
        ).remote(slot)
    assert ray.get(pool_lease(prefix).acquire.remote("rollout-task pid 42", 3600.0)) is None
print(sorted(entry["name"] for entry in ray.util.list_named_actors(all_namespaces=True)))
"""

PLACEMENT_GROUPS = r"""
import sys
import ray
from ray.util.placement_group import placement_group_table

ray.init(address=sys.argv[1], log_to_driver=False, configure_logging=False)
print(sorted(e["name"] for e in placement_group_table().values() if e["state"] != "REMOVED"))
"""


class PortForward:
    """A stand-in for ``kubectl port-forward``: each TCP connection to 127.0.0.1:``port`` is
    relayed byte for byte to ``target``; a connection it cannot relay is accepted, then
    closed (as kubectl does when the pod is gone)."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.server.getsockname()[1])
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                near, _ = self.server.accept()
            except OSError:
                return  # closed
            try:
                far = socket.create_connection(self.target, timeout=5)
            except OSError:
                near.close()
                continue
            far.settimeout(None)
            for source, sink in ((near, far), (far, near)):
                threading.Thread(target=_relay, args=(source, sink), daemon=True).start()

    def close(self) -> None:
        self.server.close()


def _relay(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        for end in (source, sink):
            try:
                end.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class TokenCluster:
    """The module's Ray head: its addresses, its token, and how to run a client of it."""

    def __init__(self, gcs: int, client: int, token: str, home: Path) -> None:
        self.gcs, self.client, self.token, self.home = gcs, client, token, home

    def env(self, **extra: str) -> dict[str, str]:
        """A client's environment: no Ray address or auth variable of the caller's, and a
        HOME without ~/.ray/auth_token (Ray's default token file)."""
        env = {key: value for key, value in os.environ.items() if key not in AUTH_VARIABLES}
        return env | {"HOME": str(self.home), "RAY_USAGE_STATS_ENABLED": "0"} | extra

    def run(self, args: list[str], **extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, *args], env=self.env(**extra), capture_output=True, text=True, timeout=180, cwd=ROOT
        )

    def pool(self, *args: str, **extra: str) -> tuple[subprocess.CompletedProcess[str], float]:
        """``drmas pool ARGS`` in its own process (Ray reads its auth settings when
        imported): the result and the seconds it took."""
        started = time.monotonic()
        done = self.run(["-m", "drmas.cli", "pool", *args], **extra)
        return done, time.monotonic() - started


@pytest.fixture(scope="module")
def cluster() -> Iterator[TokenCluster]:
    """A Ray head on 127.0.0.1 with token authentication and Ray Client, holding two runs'
    stand-in pools (``ops/held`` and ``ops/freed``); stopped by PID after the module."""
    folder = Path(tempfile.mkdtemp(prefix="drmas-tok-"))  # Ray's socket paths must stay short
    (folder / "home").mkdir()
    # Ports outside Ray's worker range (10002-19999) and Ray Client's per-client servers (23000-23999).
    gcs, client = free_port(), free_port()
    found = TokenCluster(gcs, client, secrets.token_hex(16), folder / "home")
    # GRPC_ENABLE_FORK_SUPPORT=0: Ray Client's proxy forks a server per client while its gRPC
    # threads run, and gRPC's after-fork handler then sometimes aborts the child here ("Check
    # failed: next_worker->state == KICKED": 1 first connection in 4 with it, 0 in 8 without).
    head_env = found.env(
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN=found.token,
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
        GRPC_ENABLE_FORK_SUPPORT="0",
    )
    command = [
        str(Path(sys.executable).parent / "ray"),
        "start",
        "--head",
        "--block",
        "--node-ip-address=127.0.0.1",
        f"--port={gcs}",
        f"--ray-client-server-port={client}",
        "--include-dashboard=false",
        "--num-cpus=1",
        '--resources={"pool_slot": 1}',
        f"--temp-dir={folder / 'ray'}",
    ]
    with open(folder / "head.log", "w") as log:
        head = subprocess.Popen(command, env=head_env, start_new_session=True, stdout=log, stderr=subprocess.STDOUT)
    try:
        made = None
        for _ in range(3):  # a client that finds the head still starting is answered with an error
            _wait_for_port(client, head, folder / "head.log")
            made = found.run(
                ["-c", STAND_IN_POOLS, f"ray://127.0.0.1:{client}", "ops/held", "ops/freed"],
                RAY_AUTH_MODE="token",
                RAY_AUTH_TOKEN=found.token,
            )
            if made.returncode == 0:
                break
            time.sleep(2)
        assert made is not None and made.returncode == 0, made and made.stderr[-3000:]
        yield found
    finally:
        # `ray start --block` drains for 30 s on SIGTERM; the group holds only this head's processes.
        try:
            os.killpg(head.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        head.wait(timeout=30)
        shutil.rmtree(folder, ignore_errors=True)


def _wait_for_port(port: int, head: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert head.poll() is None, log.read_text()[-3000:]
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.3)
    raise TimeoutError(f"Ray Client did not open 127.0.0.1:{port}: {log.read_text()[-3000:]}")


@pytest.fixture
def forward(cluster: TokenCluster) -> Iterator[PortForward]:
    """The operator's ``kubectl port-forward`` of the head's Ray Client port."""
    relay = PortForward(("127.0.0.1", cluster.client))
    yield relay
    relay.close()


def _said(done: subprocess.CompletedProcess[str]) -> str:
    return done.stdout + done.stderr


@pytest.mark.standin
def test_status_through_a_port_forward_with_the_token_file_or_variable(cluster, forward, tmp_path):
    """The operator's path: the token written to a file as ``kubectl get secret ... | base64
    -d`` writes it (an ``echo`` adds a newline, which Ray strips), or in $RAY_AUTH_TOKEN
    without RAY_AUTH_MODE (drmas sets the mode: Ray sends no token without it). The token is
    never printed."""
    token_file = tmp_path / "ray-token"
    token_file.write_text(cluster.token + "\n")
    address = f"ray://127.0.0.1:{forward.port}"
    for done, _ in (
        cluster.pool("status", "ops/held", "--address", address, "--token-file", str(token_file)),
        cluster.pool("status", "ops/held", "--address", address, RAY_AUTH_TOKEN=cluster.token),
    ):
        assert done.returncode == 0, done.stderr[-3000:]
        lines = done.stdout.splitlines()
        assert [line.split()[0] for line in lines[:2]] == ["drmas.ops.held.solver.slot0", "drmas.ops.held.solver.slot1"]
        assert all("version=iter-000003 resident=True" in line for line in lines[:2])
        assert lines[2].startswith("ops/held: driven by rollout-task pid 42 for ")
        assert cluster.token not in _said(done)


def test_in_a_pod_the_gcs_address_and_the_pods_token_variables_work(cluster):
    """Inside the cluster a pod joins by the GCS address, with RAY_AUTH_MODE and
    RAY_AUTH_TOKEN from the Secret (how the manifests' pods get them)."""
    done, _ = cluster.pool(
        "status",
        "ops/held",
        "--address",
        f"127.0.0.1:{cluster.gcs}",
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN=cluster.token,
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("drmas.ops.held.solver.slot") == 2


def test_down_frees_the_workers_the_lease_and_the_placement_group(cluster, forward, tmp_path):
    token_file = tmp_path / "ray-token"
    token_file.write_text(cluster.token)
    address = f"ray://127.0.0.1:{forward.port}"
    freed, _ = cluster.pool("down", "ops/freed", "--address", address, "--token-file", str(token_file))
    assert freed.returncode == 0, freed.stderr[-3000:]
    assert freed.stdout.strip() == "ops/freed: freed 2 worker(s)"
    after, _ = cluster.pool("status", "ops/freed", "--address", address, "--token-file", str(token_file))
    assert after.returncode == 0, after.stderr[-3000:]
    # No worker and no lease line: the lease actor is gone too.
    assert after.stdout.strip() == "ops/freed: no pool (never started, freed, or gone after ray.idle_timeout_s)"
    groups = cluster.run(["-c", PLACEMENT_GROUPS, address], RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=cluster.token)
    assert groups.returncode == 0, groups.stderr[-3000:]
    assert groups.stdout.strip().splitlines()[-1] == "['drmas.ops.held']"


def test_without_a_token_it_says_the_cluster_needs_one_and_how_to_get_it(cluster, forward):
    """Ray Client alone retries for about 35 s and says "ray client connection timeout"."""
    done, seconds = cluster.pool("status", "ops/held", "--address", f"ray://127.0.0.1:{forward.port}")
    assert done.returncode == 1
    assert done.stderr.strip() == (
        f"drmas pool: the Ray cluster at ray://127.0.0.1:{forward.port} requires a token: pass --token-file PATH "
        "(kubectl -n drmas get secret drmas-ray-token -o jsonpath='{.data.auth_token}' | base64 -d > PATH) "
        "or set RAY_AUTH_TOKEN"
    )
    assert seconds < 20


def test_a_wrong_token_is_refused_by_name_of_its_source_and_never_printed(cluster, forward, tmp_path):
    wrong = secrets.token_hex(16)
    token_file = tmp_path / "old-token"
    token_file.write_text(wrong)
    address = f"ray://127.0.0.1:{forward.port}"
    for done, seconds, source in (
        (*cluster.pool("status", "ops/held", "--address", address, "--token-file", str(token_file)), "--token-file "),
        (*cluster.pool("down", "ops/held", "--address", address, RAY_AUTH_TOKEN=wrong), "$RAY_AUTH_TOKEN"),
    ):
        assert done.returncode == 1
        assert f"the Ray cluster at {address} refused the token from {source}" in done.stderr
        assert "Secret drmas-ray-token, key auth_token" in done.stderr
        assert wrong not in _said(done) and cluster.token not in _said(done)
        assert seconds < 20
    # The refused `down` freed nothing.
    held, _ = cluster.pool("status", "ops/held", "--address", address, RAY_AUTH_TOKEN=cluster.token)
    assert held.stdout.count("drmas.ops.held.solver.slot") == 2


def test_a_port_forward_whose_pod_is_gone_is_told_apart_from_a_closed_port(tmp_path):
    """kubectl accepts the connection and then drops it when the pod behind it is gone."""
    from drmas.generation.named_pool import ClusterUnreachable, check_cluster

    relay = PortForward(("127.0.0.1", free_port()))  # nothing behind it
    try:
        with pytest.raises(
            ClusterUnreachable, match=rf"^127\.0\.0\.1:{relay.port} takes connections but no Ray Client"
        ):
            check_cluster(f"ray://127.0.0.1:{relay.port}", None, timeout_s=2.0)
    finally:
        relay.close()


@pytest.fixture
def no_ray_auth(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """This process's Ray settings as they were after the test (``drmas pool`` sets them)."""
    for key in AUTH_VARIABLES:
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    monkeypatch.setenv("HOME", str(tmp_path))


def test_nothing_listening_names_the_address_and_the_port_forward_to_run(no_ray_auth, capsys):
    port = free_port()
    status, out, err = drmas(capsys, "pool", "status", "ops/held", "--address", f"ray://127.0.0.1:{port}")
    assert (status, out) == (1, "")
    assert err.strip() == (
        f"drmas pool: nothing answers at 127.0.0.1:{port} (Connection refused); from outside the cluster, forward "
        "the head's Ray Client port first, and leave it running: kubectl -n drmas port-forward "
        f"svc/drmas-raycluster-head-svc {port}:10001, then pass --address ray://127.0.0.1:{port}"
    )


def test_addresses_that_only_work_inside_the_cluster_or_are_not_ray_client(no_ray_auth):
    from drmas.generation.named_pool import ClusterUnreachable, check_cluster

    with pytest.raises(ClusterUnreachable, match="cannot resolve drmas-raycluster-head-svc.drmas.svc.cluster.local"):
        check_cluster("ray://drmas-raycluster-head-svc.drmas.svc.cluster.local:10001", None, timeout_s=5)
    with pytest.raises(ClusterUnreachable, match=r"^http://127\.0\.0\.1:8265 is an HTTP address \(the dashboard's"):
        check_cluster("http://127.0.0.1:8265", None)
    check_cluster("auto", None)  # a pod's own cluster: left to Ray


def test_a_token_file_that_holds_no_token_is_a_usage_error_naming_it(no_ray_auth, capsys, tmp_path):
    empty = tmp_path / "token"
    empty.write_text("\n")
    missing = tmp_path / "absent"
    for token_file, reason in ((empty, "the file is empty"), (missing, "cannot read the token (FileNotFoundError)")):
        status, _, err = drmas(
            capsys, "pool", "status", "ops/held", "--address", "ray://127.0.0.1:1", "--token-file", str(token_file)
        )
        assert (status, err.strip()) == (2, f"drmas pool: --token-file {token_file}: {reason}")
    os.environ["RAY_AUTH_MODE"] = "token"  # restored by no_ray_auth
    status, _, err = drmas(capsys, "pool", "status", "ops/held", "--address", "ray://127.0.0.1:1")
    assert status == 2 and "RAY_AUTH_MODE=token but no token: pass --token-file PATH or set RAY_AUTH_TOKEN" in err
