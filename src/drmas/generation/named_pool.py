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
"""

from __future__ import annotations

import logging
import time

__all__ = [
    "NAMESPACE",
    "PoolLease",
    "free_pool",
    "lease_name",
    "lease_status",
    "named_placement_group",
    "pool_lease",
    "pool_name",
    "pool_status",
    "run_workers",
    "worker_name",
]


NAMESPACE = "drmas"
"""The Ray namespace of every run's named pool workers."""


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
