"""The worker-group pool on Ray: one actor per worker group over one shared device pool.

All worker groups live in one placement group over the pool (GPU bundles on a cluster; a
custom resource such as ``pool_slot`` stands in for accelerators on CPU), as in the
reference code where every model shares the same GPUs. The scheduler keeps at most
``ray.max_resident`` worker groups' weights resident and offloads the least recently used
one before making another resident, so N models fit where fewer would.

Ray starts locally by default (bound to 127.0.0.1) and joins a cluster when
``ray.address`` is set (e.g. the KubeRay head service).

A worker-group actor that dies (its process killed, its node lost) is restarted by Ray
(up to ``ACTOR_RESTARTS`` times per pool); the pool sees the failed call (or the restarted
actor's ``PolicyNotLoaded``), reloads the policy the actor held and repeats the call.
Generation is seeded per call, so the repeated call returns what the
first would have: the stage completes as if nothing happened. Past the limit the call
fails with ``WorkerGroupDied`` naming the worker group, and the stage writes nothing.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

from drmas.config import DrmasConfig, SamplingConfig
from drmas.generation.workers import GenerationResult, PolicyNotLoaded, PolicyRef, WorkerGroupRuntime
from drmas.infra.store import Store

__all__ = ["ACTOR_RESTARTS", "RAY_ADDRESS", "PoolOnDemand", "RayPool", "WorkerGroupDied", "connect_ray", "slot_request"]

log = logging.getLogger("drmas")
RAY_ADDRESS = "RAY_ADDRESS"
"""The environment variable naming a Ray to join (Ray's own convention)."""
ACTOR_RESTARTS = 3
"""How many times, per pool, a dead worker-group actor is restarted before a stage fails."""
ACTOR_RESTART_TIMEOUT_S = 120.0
"""How long to wait for Ray to bring a dead actor back (it reloads torch and the model)."""

RAY_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "disabled",
    # Ray starts workers at nice 15; the generating actors ARE the work, not background.
    "RAY_worker_niceness": "0",
}
LOOPBACK_ONLY = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
"""Set to 0, a local Ray binds every server to 127.0.0.1 (Ray reads it when imported)."""


class WorkerGroupDied(RuntimeError):
    """A worker group's actor died more often than ``ACTOR_RESTARTS`` allows."""


def connect_ray(config: DrmasConfig, temp_dir: Path | None = None) -> bool:
    """Join ``ray.address`` (else ``RAY_ADDRESS``, as ``ray.init`` reads it: how kfp-local's
    tasks share one Ray) or start a local Ray with the pool resource; True if this call
    connected. The caller then leaves with ``ray.shutdown()``, which stops only a Ray it
    started (never ``ray stop``).
    """
    for key, value in RAY_ENV.items():
        os.environ.setdefault(key, value)
    address = config.ray.address or os.environ.get(RAY_ADDRESS)
    if not config.ray.address:
        os.environ.setdefault(LOOPBACK_ONLY, "0")
    import ray  # noqa: PLC0415

    if ray.is_initialized():
        return False
    if address:
        ray.init(address=address, log_to_driver=False)
        return True
    _keep_local_ray_on_loopback()
    temp = _ray_temp_dir(temp_dir)
    temp.mkdir(parents=True, exist_ok=True)
    ray.init(
        **slot_request(config.ray.pool_resource, config.ray.pool_size, node=True),
        include_dashboard=False,
        _temp_dir=str(temp),
        log_to_driver=False,
        configure_logging=False,
    )
    return True


def slot_request(resource: str, amount: float, node: bool = False) -> dict[str, Any]:
    """How to ask Ray for ``amount`` of the pool's resource: GPUs through ``num_gpus`` (Ray
    refuses 'GPU' among custom ``resources``: "Use the 'num_cpus' and 'num_gpus' keyword"),
    any other name as a custom resource. ``node``: for ``ray.init`` of a local node, whose
    ``num_gpus`` is a whole count."""
    if resource == "GPU":
        return {"num_gpus": int(amount) if node else amount}
    return {"resources": {resource: amount}}


def _keep_local_ray_on_loopback() -> None:
    """Ray read ``LOOPBACK_ONLY`` when first imported, which may have been before
    ``connect_ray`` set it (a test, a notebook): apply it to the constant it was read into."""
    from ray._private import ray_constants  # noqa: PLC0415

    if os.environ.get(LOOPBACK_ONLY) == "0":
        ray_constants.ENABLE_RAY_CLUSTER = False


def _ray_temp_dir(preferred: Path | None) -> Path:
    """Ray's session folder holds Unix sockets, whose paths may not exceed 107 bytes: use
    the preferred folder when it is short enough, else a short one under the system temp."""
    if preferred is not None and len(str(Path(preferred).resolve())) <= 40:
        return Path(preferred).resolve()
    return Path(os.environ.get("RAY_TMPDIR") or tempfile.gettempdir()) / f"drmas-ray-{os.getuid()}"


class RayPool:
    """Worker-group actors and the residency scheduler. Use as a context manager."""

    def __init__(
        self, config: DrmasConfig, store: Store, cache_dir: Path | None = None, threads: int | None = None
    ) -> None:
        import ray  # noqa: PLC0415
        from ray.util.placement_group import placement_group  # noqa: PLC0415
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy  # noqa: PLC0415

        self.config = config
        self.max_resident = config.ray.max_resident
        self.resident: OrderedDict[str, None] = OrderedDict()  # least recently used first
        self.loads = 0
        self.restarts = 0
        self.policies: dict[str, PolicyRef] = {}
        groups = config.worker_groups()
        resource, slots = config.ray.pool_resource, config.ray.pool_size
        self.placement = placement_group([{resource: 1.0}] * slots, strategy="PACK")
        ray.get(self.placement.ready(), timeout=120)
        per_slot = [sum(1 for i in range(len(groups)) if i % slots == s) for s in range(slots)]
        actor_class = ray.remote(WorkerGroupRuntime)
        threads = threads or os.cpu_count() or 1
        self.actors = {
            group.name: actor_class.options(
                num_cpus=0,
                **slot_request(resource, 1.0 / per_slot[index % slots]),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.placement, placement_group_bundle_index=index % slots
                ),
                name=None,
                max_restarts=ACTOR_RESTARTS,
            ).remote(
                group.name,
                store.settings(),
                engine=config.rollout.engine,
                dtype=group.spec.dtype if group.spec else "float32",
                max_prompt_tokens=config.rollout.max_prompt_tokens,
                truncation=config.rollout.truncation,
                chat_template_kwargs=group.chat_template_kwargs,
                cache_dir=str(cache_dir) if cache_dir else None,
                threads=threads,
            )
            for index, group in enumerate(groups)
        }

    def __enter__(self) -> RayPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        import ray  # noqa: PLC0415
        from ray.util.placement_group import remove_placement_group  # noqa: PLC0415

        for actor in self.actors.values():
            ray.kill(actor)
        self.actors = {}
        remove_placement_group(self.placement)

    def load(self, policies: dict[str, PolicyRef]) -> None:
        """Point every worker group at its policy version; actors reload only on change.

        Loading makes a worker group resident, so the residency limit holds here too.
        """

        missing = set(self.actors) - set(policies)
        if missing:
            raise ValueError(f"no policy given for worker group(s): {', '.join(sorted(missing))}")
        for wg, policy in policies.items():
            self._make_room(wg)
            self.policies[wg] = policy
            self.loads += int(self._call(wg, "load_policy", policy))
            self._mark_resident(wg)

    def generate(self, wg: str, messages: list[str], sampling: SamplingConfig, seed: int) -> list[GenerationResult]:
        self._make_resident(wg)
        return self._call(wg, "generate", messages, sampling, seed)

    def status(self) -> dict[str, dict[str, object]]:
        return {wg: self._call(wg, "status") for wg in self.actors}

    def _call(self, wg: str, method: str, *args: object):
        """Call an actor's method; if the actor died, let Ray restart it, bring it back to
        the state the pool believes it is in, and call again."""
        import ray  # noqa: PLC0415

        for _ in range(ACTOR_RESTARTS + 2):
            try:
                return ray.get(getattr(self.actors[wg], method).remote(*args))
            except (ray.exceptions.RayActorError, PolicyNotLoaded) as error:
                if isinstance(error, PolicyNotLoaded) and wg not in self.policies:
                    raise  # a caller's mistake, not a restart
                failure = error
                if self._came_back_empty(wg, method, error):
                    self._restore(wg, method)
        self._give_up(wg, method, failure)

    def _came_back_empty(self, wg: str, method: str, error: Exception) -> bool:
        """Wait (bounded) until the actor answers again; True if it is a restarted, empty one."""
        import ray  # noqa: PLC0415

        deadline = time.monotonic() + ACTOR_RESTART_TIMEOUT_S
        while True:
            try:
                status = ray.get(self.actors[wg].status.remote(), timeout=ACTOR_RESTART_TIMEOUT_S)
                break
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as again:
                if isinstance(again, ray.exceptions.ActorDiedError) or time.monotonic() > deadline:
                    self._give_up(wg, method, again)
                time.sleep(0.2)
        if status["version"] is not None or wg not in self.policies:
            return False
        self.restarts += 1
        if self.restarts > ACTOR_RESTARTS:
            self._give_up(wg, method, error)
        log.warning(
            "worker group %s: its Ray actor died during %s; restarted (%d/%d), reloading its policy",
            wg,
            method,
            self.restarts,
            ACTOR_RESTARTS,
        )
        return True

    def _give_up(self, wg: str, method: str, error: Exception) -> None:
        reason = str(error).splitlines()[0][:300] if str(error) else type(error).__name__
        raise WorkerGroupDied(
            f"worker group {wg!r}: its Ray actor died during {method} and could not be brought back "
            f"({self.restarts} restart(s) so far; {reason}); the stage stopped and wrote nothing"
        ) from None

    def _restore(self, wg: str, method: str) -> None:
        """Bring a restarted actor back to the state the pool believes it is in: holding its
        policy, and offloaded unless resident (or about to be made so by ``method``)."""
        if method == "load_policy":
            return
        self._call(wg, "load_policy", self.policies[wg])
        if wg not in self.resident and method not in ("offload", "resume"):
            self._call(wg, "offload")

    def _make_resident(self, wg: str) -> None:
        if wg in self.resident:
            self.resident.move_to_end(wg)
            return
        self._make_room(wg)
        self._call(wg, "resume")
        self._mark_resident(wg)

    def _make_room(self, wg: str) -> None:
        while wg not in self.resident and len(self.resident) >= self.max_resident:
            evicted, _ = self.resident.popitem(last=False)
            self._call(evicted, "offload")

    def _mark_resident(self, wg: str) -> None:
        self.resident[wg] = None
        self.resident.move_to_end(wg)


class PoolOnDemand:
    """The Ray pool, started on first use: a rerun that recomputes nothing starts no Ray."""

    def __init__(self, config: DrmasConfig, store: Store, cache_dir: Path | None) -> None:
        self.config, self.store, self.cache_dir = config, store, cache_dir
        self.pool = None
        self.started_ray = False

    def __call__(self):
        if self.pool is None:
            self.started_ray = connect_ray(self.config, self.cache_dir / "ray" if self.cache_dir else None)
            self.pool = RayPool(
                self.config, self.store, cache_dir=self.cache_dir / "policies" if self.cache_dir else None
            )
        return self.pool

    def __enter__(self) -> PoolOnDemand:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.pool is not None:
            self.pool.close()
        if self.started_ray:
            import ray  # noqa: PLC0415

            ray.shutdown()
