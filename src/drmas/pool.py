"""The worker-group pool on Ray: one actor per worker group over one shared device pool.

All worker groups live in one placement group over the pool (GPU bundles on a cluster; a
custom resource such as ``pool_slot`` stands in for accelerators on CPU), as in the
reference code where every model shares the same GPUs. The scheduler keeps at most
``ray.max_resident`` worker groups' weights resident and offloads the least recently used
one before making another resident, so N models fit where fewer would.

Ray starts locally by default (bound to 127.0.0.1) and joins a cluster when
``ray.address`` is set (e.g. the KubeRay head service).
"""

from __future__ import annotations

import os
import tempfile
from collections import OrderedDict
from pathlib import Path

from drmas.config import DrmasConfig, SamplingConfig
from drmas.store import Store
from drmas.workers import GenerationResult, PolicyRef, WorkerGroupRuntime

__all__ = ["RayPool", "connect_ray"]

RAY_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "disabled",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
}


def connect_ray(config: DrmasConfig, temp_dir: Path | None = None) -> bool:
    """Join ``ray.address`` or start a local Ray with the pool resource; True if started here.

    A caller that started Ray shuts it down with ``ray.shutdown()`` (never ``ray stop``).
    """
    import ray  # noqa: PLC0415

    for key, value in RAY_ENV.items():
        os.environ.setdefault(key, value)
    if ray.is_initialized():
        return False
    if config.ray.address:
        ray.init(address=config.ray.address, log_to_driver=False)
        return True
    temp = _ray_temp_dir(temp_dir)
    temp.mkdir(parents=True, exist_ok=True)
    ray.init(
        resources={config.ray.pool_resource: config.ray.pool_size},
        include_dashboard=False,
        _temp_dir=str(temp),
        log_to_driver=False,
        configure_logging=False,
    )
    return True


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
                resources={resource: 1.0 / per_slot[index % slots]},
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.placement, placement_group_bundle_index=index % slots
                ),
                name=None,
            ).remote(
                group.name,
                store.settings(),
                engine=config.rollout.engine,
                dtype=group.spec.dtype if group.spec else "float32",
                max_prompt_tokens=config.rollout.max_prompt_tokens,
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
        import ray  # noqa: PLC0415

        missing = set(self.actors) - set(policies)
        if missing:
            raise ValueError(f"no policy given for worker group(s): {', '.join(sorted(missing))}")
        for wg, policy in policies.items():
            self._make_room(wg)
            self.loads += int(ray.get(self.actors[wg].load_policy.remote(policy)))
            self._mark_resident(wg)

    def generate(self, wg: str, messages: list[str], sampling: SamplingConfig, seed: int) -> list[GenerationResult]:
        import ray  # noqa: PLC0415

        self._make_resident(wg)
        return ray.get(self.actors[wg].generate.remote(messages, sampling, seed))

    def status(self) -> dict[str, dict[str, object]]:
        import ray  # noqa: PLC0415

        return {wg: ray.get(actor.status.remote()) for wg, actor in self.actors.items()}

    def _make_resident(self, wg: str) -> None:
        import ray  # noqa: PLC0415

        if wg in self.resident:
            self.resident.move_to_end(wg)
            return
        self._make_room(wg)
        ray.get(self.actors[wg].resume.remote())
        self._mark_resident(wg)

    def _make_room(self, wg: str) -> None:
        import ray  # noqa: PLC0415

        while wg not in self.resident and len(self.resident) >= self.max_resident:
            evicted, _ = self.resident.popitem(last=False)
            ray.get(self.actors[evicted].offload.remote())

    def _mark_resident(self, wg: str) -> None:
        self.resident[wg] = None
        self.resident.move_to_end(wg)
