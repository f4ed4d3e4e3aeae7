"""A run's pool as the Ray cluster holds it: a named, detached placement group, its named
worker actors and its lease, found by name by every stage of the run (embedded, or a
Kubeflow task that joins the cluster), listed (``drmas pool status``) and freed (``drmas
pool down``, the end of a run, or a worker's idle watchdog).

The lease (``PoolLease``, one named actor per run) lets one driver use the pool at a time:
each keeps its own record of which engines are resident and which policy each worker
group holds, so two drivers at once (two Kubeflow tasks Argo started together) would load
two engines onto one device, or generate from weights the other just swapped in. A driver
takes the lease before it looks up or creates the pool, so that lookup-or-create is
atomic too; a second driver waits for it. A Ray actor runs its calls one at a time, which
makes taking the lease atomic, and its own clock times the holder's heartbeats, so hosts'
clocks need not agree.

Its own module because both sides need it: the driver's pool (``generation.pool``) and the
workers themselves (``generation.workers``, whose watchdog frees an idle pool). Its functions
import Ray themselves: ``generation.workers`` is also imported where no Ray runs (the warm
start's prompt truncation, the rollout's result type).

An operator reaches a cluster's pools from outside it through a port-forward of the head's
Ray Client port and the cluster's token (``check_cluster`` says what stands in the way
before ``ray.init`` would retry for half a minute and say only "connection timeout").
"""

from __future__ import annotations

import logging
import socket
import time
from urllib.parse import urlsplit

__all__ = [
    "CLIENT_PORT",
    "CLUSTER_NAMESPACE",
    "HEAD_SERVICE",
    "NAMESPACE",
    "TOKEN_COMMAND",
    "ClusterUnreachable",
    "PoolLease",
    "check_cluster",
    "free_pool",
    "lease_name",
    "lease_status",
    "named_placement_group",
    "pool_lease",
    "pool_name",
    "pool_status",
    "port_forward_command",
    "run_workers",
    "worker_name",
]


NAMESPACE = "drmas"
"""The Ray namespace of every run's named pool workers."""

HEAD_SERVICE = "drmas-raycluster-head-svc"
"""The head's Service of the RayCluster in manifests/base, whose port 10001 is Ray Client
and 8265 the dashboard; in the Kubernetes namespace ``CLUSTER_NAMESPACE``."""

CLUSTER_NAMESPACE = "drmas"
"""The Kubernetes namespace of the RayCluster and its Secret ``drmas-ray-token``."""

CLIENT_PORT = 10001
"""Ray Client's port on the head (KubeRay's default, and Ray's for ``ray://HOST``)."""

TOKEN_COMMAND = (
    f"kubectl -n {CLUSTER_NAMESPACE} get secret drmas-ray-token -o jsonpath='{{.data.auth_token}}' | base64 -d"
)
"""Prints the cluster's Ray token (the Secret the RayCluster's ``authOptions`` names)."""


def port_forward_command(local_port: int) -> str:
    """The command that makes the head's Ray Client port ``ray://127.0.0.1:local_port``."""
    return f"kubectl -n {CLUSTER_NAMESPACE} port-forward svc/{HEAD_SERVICE} {local_port}:{CLIENT_PORT}"


class _RemovedWithItsPlacementGroup(logging.Filter):
    """Ray warns that a restartable detached actor in a placement group dies with the
    group: for a run's pool workers that is the point (``free_pool`` removes both)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "restartable detached actor with a placement group" not in record.getMessage()


logging.getLogger("ray.actor").addFilter(_RemovedWithItsPlacementGroup())


def pool_name(experiment: str, run_id: str) -> str:
    """The name of a run's placement group, and the prefix of its workers' names."""
    return f"drmas.{experiment}.{run_id}"


def worker_name(prefix: str, wg: str, slot: int) -> str:
    return f"{prefix}.{wg}.slot{slot}"


def lease_name(prefix: str) -> str:
    """The name of a pool's lease actor (not a worker's: ``run_workers`` does not list it)."""
    return f"{prefix}:lease"


class PoolLease:
    """Who drives a run's pool now (a Ray actor: its calls run one at a time).

    A holder renews the lease by heartbeats; one silent for longer than its ``stale_after_s``
    is taken for dead (a killed task) and the lease goes to the next driver that asks."""

    def __init__(self) -> None:
        self.holder: str | None = None
        self.since = self.renewed = 0.0
        self.stale_after_s = 0.0

    def acquire(self, holder: str, stale_after_s: float) -> str | None:
        """Take the lease for ``holder``; returns None when taken, else who holds it."""
        now = time.monotonic()
        if self.holder is not None and self.holder != holder and now - self.renewed <= self.stale_after_s:
            return self.holder
        if self.holder != holder:
            self.since = now
        self.holder, self.renewed, self.stale_after_s = holder, now, stale_after_s
        return None

    def renew(self, holder: str) -> bool:
        """A heartbeat; False when ``holder`` no longer holds the lease (taken over as stale)."""
        if self.holder != holder:
            return False
        self.renewed = time.monotonic()
        return True

    def release(self, holder: str) -> None:
        if self.holder == holder:
            self.holder = None

    def status(self) -> dict[str, object]:
        now = time.monotonic()
        if self.holder is None:
            return {"holder": None}
        return {"holder": self.holder, "held_s": round(now - self.since, 1), "silent_s": round(now - self.renewed, 1)}


def pool_lease(prefix: str):
    """The lease actor of the pool ``prefix``, created if missing (atomically: Ray's
    ``get_if_exists`` creates a named actor once, whoever asks at the same time)."""
    import ray  # noqa: PLC0415

    return (
        ray.remote(PoolLease)
        .options(name=lease_name(prefix), namespace=NAMESPACE, lifetime="detached", get_if_exists=True, num_cpus=0)
        .remote()
    )


def named_placement_group(name: str):
    """The live placement group called ``name`` (looked up in the cluster's table: names
    of placement groups are scoped to a namespace, and stage processes join with their own)."""
    from ray._raylet import PlacementGroupID  # noqa: PLC0415
    from ray.util.placement_group import PlacementGroup, placement_group_table  # noqa: PLC0415

    for pg_id, entry in placement_group_table().items():
        if entry.get("name") == name and entry.get("state") in ("CREATED", "PENDING", "RESCHEDULING"):
            return PlacementGroup(PlacementGroupID(bytes.fromhex(pg_id)))
    return None


def run_workers(prefix: str) -> list[str]:
    import ray  # noqa: PLC0415

    return sorted(
        entry["name"]
        for entry in ray.util.list_named_actors(all_namespaces=True)
        if entry["namespace"] == NAMESPACE and entry["name"].startswith(prefix + ".")
    )


def lease_status(experiment: str, run_id: str) -> dict[str, object] | None:
    """Who drives a run's pool now (``drmas pool status``); None when it has no lease."""
    import ray  # noqa: PLC0415

    try:
        lease = ray.get_actor(lease_name(pool_name(experiment, run_id)), namespace=NAMESPACE)
        return ray.get(lease.status.remote(), timeout=30)
    except (ValueError, ray.exceptions.RayError):
        return None


def pool_status(experiment: str, run_id: str) -> list[dict[str, object]]:
    """Each live worker of a run's pool: its name and what it holds (``drmas pool status``)."""
    import ray  # noqa: PLC0415

    found = []
    for name in run_workers(pool_name(experiment, run_id)):
        try:
            status = ray.get(ray.get_actor(name, namespace=NAMESPACE).status.remote(), timeout=30)
        except (ValueError, ray.exceptions.RayError) as error:
            status = {"error": type(error).__name__}
        found.append({"worker": name, **status})
    return found


def free_pool(experiment: str, run_id: str, keep: object = None) -> int:
    """Kill a run's pool workers and its lease, and remove its placement group; returns how
    many workers were killed. ``keep``: an actor handle to kill last (the caller itself)."""
    import ray  # noqa: PLC0415
    from ray.util.placement_group import remove_placement_group  # noqa: PLC0415

    prefix = pool_name(experiment, run_id)
    killed = 0
    for name in run_workers(prefix):
        try:
            handle = ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            continue  # gone meanwhile
        if keep is not None and handle._actor_id == keep._actor_id:
            continue
        ray.kill(handle, no_restart=True)
        killed += 1
    try:
        ray.kill(ray.get_actor(lease_name(prefix), namespace=NAMESPACE), no_restart=True)
    except ValueError:
        pass  # never leased (a pool of an older drmas) or freed meanwhile
    placement = named_placement_group(prefix)
    if placement is not None:
        remove_placement_group(placement)
    if keep is not None:
        ray.kill(keep, no_restart=True)
        killed += 1
    return killed


class ClusterUnreachable(Exception):
    """Why the Ray cluster at an address cannot be joined, said so that an operator can act."""


def check_cluster(address: str, token_from: str | None, timeout_s: float = 10.0) -> None:
    """Before joining the Ray cluster at ``address``, find what would stop ``ray.init``:
    nothing listening there (raised with the port-forward that reaches a cluster from
    outside), or, for a Ray Client address (``ray://``), a server that is not Ray Client, one
    that wants a token and got none, or one that refused the token. ``token_from`` says where
    the token comes from (``--token-file PATH``), None when none is sent; messages name it
    and never the token. Ray Client itself retries for about 35 s and then says only "ray
    client connection timeout", for a wrong token as for a closed port. An ``auto`` or
    ``local`` address is left to ``ray.init``; so is a GCS address's token (only a pod in
    the cluster can use one: a driver also talks to every node)."""
    if address.startswith(("http://", "https://")):
        raise ClusterUnreachable(
            f"{address} is an HTTP address (the dashboard's, port 8265, serves jobs, not drivers): "
            f"drmas pool joins as a Ray Client; {_forward_hint(CLIENT_PORT)}"
        )
    client = address.startswith("ray://")
    parts = urlsplit(address if "://" in address else f"gcs://{address}")
    try:
        host, port = parts.hostname, parts.port or (CLIENT_PORT if client else None)
    except ValueError as error:  # a port that is not a number
        raise ClusterUnreachable(f"{address}: {error}") from error
    if not host or port is None:
        return  # auto, local: Ray's own lookup
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"  # IPv6 in brackets
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except socket.gaierror as error:
        raise ClusterUnreachable(
            f"cannot resolve {host} ({error.strerror}): a cluster's Service names resolve only "
            f"inside it; {_forward_hint(port if client else CLIENT_PORT)}"
        ) from error
    except OSError as error:
        raise ClusterUnreachable(
            f"nothing answers at {where} ({error.strerror or type(error).__name__}); "
            f"{_forward_hint(port if client and _is_loopback(host) else CLIENT_PORT)}"
        ) from error
    if client:
        _ping_ray_client(address, where, token_from, timeout_s)


def _ping_ray_client(address: str, where: str, token_from: str | None, timeout_s: float) -> None:
    """One PING of Ray Client over a channel made as Ray Client makes it (with Ray's token
    interceptor when ``RAY_AUTH_MODE=token``): the server's token check answers at once."""
    import grpc  # noqa: PLC0415
    from ray._private.grpc_utils import init_grpc_channel  # noqa: PLC0415
    from ray.core.generated import ray_client_pb2, ray_client_pb2_grpc  # noqa: PLC0415

    channel = init_grpc_channel(where)
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout_s)
        ping = ray_client_pb2.ClusterInfoRequest(type=ray_client_pb2.ClusterInfoType.PING)
        ray_client_pb2_grpc.RayletDriverStub(channel).ClusterInfo(ping, timeout=timeout_s)
    except grpc.FutureTimeoutError as error:
        raise ClusterUnreachable(
            f"{where} takes connections but no Ray Client answers there within {timeout_s:.0f} s "
            "(a port-forward whose pod is gone, or another service's port)"
        ) from error
    except grpc.RpcError as error:
        if error.code() == grpc.StatusCode.UNAUTHENTICATED:
            raise ClusterUnreachable(_token_refused(address, token_from)) from error
        said = ": ".join(filter(None, (error.code().name, error.details())))
        raise ClusterUnreachable(
            f"{where} does not answer as Ray Client ({said}); {_forward_hint(CLIENT_PORT)}"
        ) from error
    finally:
        channel.close()


def _token_refused(address: str, token_from: str | None) -> str:
    fetch = f"{TOKEN_COMMAND} > PATH"
    if token_from is None:
        return f"the Ray cluster at {address} requires a token: pass --token-file PATH ({fetch}) or set RAY_AUTH_TOKEN"
    return (
        f"the Ray cluster at {address} refused the token from {token_from}: it is not the cluster's "
        f"(Secret drmas-ray-token, key auth_token: {fetch})"
    )


def _forward_hint(local_port: int) -> str:
    return (
        "from outside the cluster, forward the head's Ray Client port first, and leave it running: "
        f"{port_forward_command(local_port)}, then pass --address ray://127.0.0.1:{local_port}"
    )


def _is_loopback(host: str) -> bool:
    return host == "localhost" or host.startswith("127.") or host == "::1"
