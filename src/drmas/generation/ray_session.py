"""Ray for a process of drmas: join a cluster (``ray.address``, else ``RAY_ADDRESS``) or
start a local Ray bound to 127.0.0.1 with the pool's resource, and leave it without
stopping anyone else's (``ray.shutdown()``, never ``ray stop``)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from drmas.config import DrmasConfig

__all__ = ["RAY_ADDRESS", "connect_ray", "ray_session", "slot_request"]


RAY_ADDRESS = "RAY_ADDRESS"
"""The environment variable naming a Ray to join (Ray's own convention)."""


RAY_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    # Ray starts workers at nice 15; the generating actors ARE the work, not background.
    "RAY_worker_niceness": "0",
}


LOCAL_AUTH = ("RAY_AUTH_MODE", "disabled")
"""A local Ray's authentication (off); a cluster's is left to its settings."""


LOOPBACK_ONLY = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
"""Set to 0, a local Ray binds every server to 127.0.0.1 (Ray reads it when imported)."""


def connect_ray(config: DrmasConfig, temp_dir: Path | None = None) -> bool:
    """Join ``ray.address`` (else ``RAY_ADDRESS``, as ``ray.init`` reads it: how kfp-local's
    tasks share one Ray) or start a local Ray with the pool resource; True if this call
    connected. ``ray_session`` pairs it with the ``ray.shutdown()`` that leaves it.
    """
    for key, value in RAY_ENV.items():
        os.environ.setdefault(key, value)
    address = config.ray.address or os.environ.get(RAY_ADDRESS)
    if not config.ray.address:
        # A Ray of this machine, on loopback only: no token to hand around. A cluster's
        # authentication is the cluster's (RAY_AUTH_MODE=token, RAY_AUTH_TOKEN from the
        # drmas-ray-token Secret on the pods that drive the pool).
        os.environ.setdefault(LOOPBACK_ONLY, "0")
        os.environ.setdefault(LOCAL_AUTH[0], LOCAL_AUTH[1])
    import ray  # noqa: PLC0415 - after the environment above: Ray reads LOOPBACK_ONLY when imported

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


@contextmanager
def ray_session(config: DrmasConfig, temp_dir: Path | None = None) -> Iterator[None]:
    """Ray for a block (``connect_ray``), left by ``ray.shutdown()`` only when this call
    connected: that stops a local Ray it started and leaves a cluster running (never
    ``ray stop``)."""
    started = connect_ray(config, temp_dir)
    try:
        yield
    finally:
        if started:
            import ray  # noqa: PLC0415

            ray.shutdown()


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
