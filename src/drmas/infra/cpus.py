"""What this machine's CPU offers drmas's torch work: its threads (native bf16: ``drmas.config.hardware``)."""

from __future__ import annotations

import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
"""Where the process's own cgroup is mounted (inside a container: the container's)."""


def cpu_threads(environment: bool = True) -> int:
    """``OMP_NUM_THREADS`` when it is set to a positive number (and ``environment``), else
    the CPUs this process may use: its CPU affinity, capped by its cgroup's CPU quota
    (``cgroup_cpu_quota``). A Ray actor that asks for no CPU passes ``environment=False``:
    Ray sets ``OMP_NUM_THREADS=1`` in it (``ray._private.utils.set_omp_num_threads_if_unset``),
    which says nothing of the container it runs in.

    torch reads the same variable for its own default, so setting it is how a user shares
    one machine between jobs (a test runner with several workers, two runs side by side):
    the pool's workers and the warm starts divide these threads instead of each taking every
    core, which on a small machine makes them several times slower than one thread each.
    In a container ``os.cpu_count()`` is the node's count (say 128) while the pod may
    use only its CPU limit (say 16): the quota is what the process gets, and threads
    beyond it only wait for CPU time."""
    value = os.environ.get("OMP_NUM_THREADS", "") if environment else ""
    if value.strip().isdigit() and int(value) > 0:
        return int(value)
    available = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = cgroup_cpu_quota(CGROUP_ROOT)
    return max(1, min(available, quota) if quota is not None else available)


def cgroup_cpu_quota(root: Path = CGROUP_ROOT) -> int | None:
    """The CPUs the process's cgroup may use per period, rounded up (a Kubernetes limit of
    ``2500m`` gives 3), or None without a quota. Reads cgroup v2's ``cpu.max`` (``"250000
    100000"``; ``"max 100000"`` is no quota), else cgroup v1's ``cpu.cfs_quota_us`` and
    ``cpu.cfs_period_us`` (quota -1: none). In a container the mounted cgroup is the
    container's own; on a host it is the root, which has no quota."""
    try:
        quota, _, period = (root / "cpu.max").read_text().strip().partition(" ")
        if quota == "max":
            return None
        return _cpus(int(quota), int(period))
    except (OSError, ValueError):
        pass
    for v1 in (root / "cpu", root / "cpu,cpuacct", root):
        try:
            quota_us = int((v1 / "cpu.cfs_quota_us").read_text())
            period_us = int((v1 / "cpu.cfs_period_us").read_text())
        except (OSError, ValueError):
            continue
        return None if quota_us <= 0 else _cpus(quota_us, period_us)
    return None


def _cpus(quota: int, period: int) -> int | None:
    """``quota / period`` CPUs, rounded up; None for a period that makes no sense."""
    return -(-quota // period) if period > 0 and quota > 0 else None
