"""Residency scheduling: three ~20M-parameter worker groups with ``max_resident: 1`` against
all three resident, on the search team (Verifier, Search, Answer, one model each).

    .venv/bin/python bench/pool_residency.py [--iterations 2]

Both settings run the same rollouts (same seed, same prompts) in one script; a sampler
thread reads the resident memory (RSS) of the three actor processes every 20 ms. Prints
the peak of their sum, the wall time per setting, and the ratios.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

from drmas.config import load_config
from drmas.generation.pool import RayPool
from drmas.generation.ray_session import ray_session
from drmas.infra.store import Store
from drmas.stages.policies import init_policies
from drmas.stages.rollout import rollout

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from common import MODEL_20M


def rss(pid: int) -> int:
    """Resident memory of a process, from /proc (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


class PeakRss:
    """Samples the summed RSS of some processes in a thread; ``peak`` in bytes."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, sum(rss(pid) for pid in self.pids))
            time.sleep(0.02)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def measure(max_resident: int, iterations: int, scratch: Path) -> tuple[float, int]:
    config = load_config(
        ROOT / "configs" / "search_tiny.yaml",
        [*MODEL_20M, "workers.sharing=none", f"ray.max_resident={max_resident}", "rollout.prompts_per_iteration=8"],
    )
    store = Store(str(scratch / "store"))
    policies = init_policies(config, store, "bench")
    with RayPool(config, store, cache_dir=scratch / f"cache-{max_resident}") as pool:
        pids = [worker["pid"] for workers in pool.status().values() for worker in workers]
        with PeakRss(pids) as sampler:
            started = time.perf_counter()
            for iteration in range(iterations):
                rollout(config, store, f"bench-{max_resident}", iteration, policies, pool)
            seconds = time.perf_counter() - started
    return seconds, sampler.peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        config = load_config(ROOT / "configs" / "search_tiny.yaml")
        with ray_session(config, Path(scratch) / "ray"):
            one = measure(1, args.iterations, Path(scratch))
            three = measure(3, args.iterations, Path(scratch))
    print(f"{'max_resident':>12} {'seconds':>8} {'peak RSS (3 actors)':>20}")
    for label, (seconds, peak) in (("1", one), ("3 (all)", three)):
        print(f"{label:>12} {seconds:8.1f} {peak / 2**20:17.0f} MiB")
    print(f"time ratio 1/all: {one[0] / three[0]:.2f}x, peak memory ratio 1/all: {one[1] / three[1]:.2f}x")
    print(f"memory saved by offloading: {(three[1] - one[1]) / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
