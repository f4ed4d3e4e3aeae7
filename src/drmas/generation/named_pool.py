"""A run's pool as the Ray cluster holds it: a named, detached placement group and its named
worker actors, found by name by every stage of the run (embedded, or a Kubeflow task that
joins the cluster), listed (``drmas pool status``) and freed (``drmas pool down``, the end of
a run, or a worker's idle watchdog).

Its own module because both sides need it: the driver's pool (``generation.pool``) and the
workers themselves (``generation.workers``, whose watchdog frees an idle pool). Its functions
import Ray themselves: ``generation.workers`` is also imported where no Ray runs (the warm
start's prompt truncation, the rollout's result type).
"""

from __future__ import annotations

import logging

__all__ = ["NAMESPACE", "free_pool", "named_placement_group", "pool_name", "pool_status", "run_workers", "worker_name"]


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
    """Kill a run's pool workers and remove its placement group; returns how many workers
    were killed. ``keep``: an actor handle to kill last (the caller itself)."""
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
    placement = named_placement_group(prefix)
    if placement is not None:
        remove_placement_group(placement)
    if keep is not None:
        ray.kill(keep, no_restart=True)
        killed += 1
    return killed
