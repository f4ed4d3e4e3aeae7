"""One driver of a run's pool at a time (issue 29 §1): the pool's lease, on a real local Ray,
and a worker that refuses to generate from a policy other than the one its caller expects.

Why: Argo starts every task whose dependencies are done, and each task's pool object keeps
its own record of which engines are resident and which policy each worker group holds. Two
at once would load two engines onto one device, or a stage would generate from weights
another stage swapped in. The pipelines' pool edges order the tasks; the lease and the
policy check make a pipeline without them fail or wait instead of mixing.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from drmas.config import load_config
from drmas.generation.named_pool import free_pool, lease_status, pool_lease, pool_name
from drmas.generation.pool import HeldLease, PoolBusy, PoolLeaseLost, RayPool, policy_cache_scope
from drmas.generation.workers import PolicyMismatch, WorkerGroupRuntime
from drmas.infra.store import Store
from drmas.stages.policies import init_policies

CONFIGS = Path(__file__).parent.parent / "configs"
SMALL = [
    "models.tiny.hidden_size=32",
    "models.tiny.intermediate_size=64",
    "models.tiny.num_layers=1",
    "workers.sharing=none",
]


def test_taking_the_lease_is_atomic(local_ray):
    """Sixteen drivers ask at once: exactly one gets the lease; the others are told who has it."""
    import ray

    lease = pool_lease("drmas.lease-test.atomic")
    answers = ray.get([lease.acquire.remote(f"driver-{i}", 60.0) for i in range(16)])
    winners = [f"driver-{i}" for i, answer in enumerate(answers) if answer is None]
    assert len(winners) == 1
    assert {answer for answer in answers if answer is not None} == set(winners)
    ray.kill(lease, no_restart=True)


def test_a_second_driver_waits_for_the_first_and_gives_up_when_told(local_ray, capsys):
    prefix = "drmas.lease-test.wait"
    first = HeldLease(prefix, stale_after_s=4.0)
    taken: list[float] = []

    def second_driver() -> None:
        second = HeldLease(prefix, stale_after_s=4.0, wait_s=60.0)
        taken.append(time.monotonic())
        second.release()

    waiting = threading.Thread(target=second_driver)
    waiting.start()
    time.sleep(3.0)  # several heartbeats: the first stays live, the second keeps waiting
    assert not taken
    with pytest.raises(PoolBusy, match=rf"{prefix} has been driven by .*pid"):
        HeldLease(prefix, stale_after_s=4.0, wait_s=0.5)
    released = time.monotonic()
    first.release()
    waiting.join(timeout=30)
    assert taken and taken[0] >= released
    first.check()  # released, not lost


def test_a_silent_drivers_lease_goes_stale_and_a_freed_pool_takes_it_away(local_ray):
    """A driver that stops beating (a killed task) loses the lease after ``stale_after_s``;
    a driver whose pool is freed (``drmas pool down``, the idle watchdog) learns it at its
    next use of the pool."""
    prefix = pool_name("lease-test", "stale")
    silent = HeldLease(prefix, stale_after_s=1.0)
    silent.stopped.set()  # its heartbeat stops, as a killed process's would
    started = time.monotonic()
    successor = HeldLease(prefix, stale_after_s=1.0, wait_s=30.0)
    assert 0.5 < time.monotonic() - started < 10
    assert lease_status("lease-test", "stale")["holder"] == successor.holder
    free_pool("lease-test", "stale")
    deadline = time.monotonic() + 10
    while not successor.lost.is_set() and time.monotonic() < deadline:
        time.sleep(0.1)
    with pytest.raises(PoolLeaseLost, match="lost the lease on the run's pool drmas.lease-test.stale"):
        successor.check()
    assert lease_status("lease-test", "stale") is None


def test_a_runs_pool_holds_the_lease_while_open(local_ray, tmp_path):
    config = load_config(CONFIGS / "math_tiny.yaml", SMALL)
    store = Store(str(tmp_path / "store"))
    with RayPool(config, store, cache_dir=tmp_path / "cache", threads=1, run=("lease-test", "open")) as pool:
        assert lease_status("lease-test", "open")["holder"] == pool.lease.holder
    assert lease_status("lease-test", "open")["holder"] is None
    free_pool("lease-test", "open")


def test_a_worker_refuses_to_generate_from_a_policy_it_does_not_hold(tmp_path):
    """The evaluation before training loaded the warm start; an update then handed the
    worker new weights. The evaluation's next call names the policy it loaded: refused."""
    config = load_config(CONFIGS / "math_tiny.yaml", [*SMALL, f"store.root={tmp_path / 'store'}"])
    store = Store.from_config(config.store)
    policies = init_policies(config, store, "run")
    worker = WorkerGroupRuntime("solver", store.settings(), cache_dir=str(tmp_path / "cache"), threads=1)
    worker.load_policy(policies["solver"])
    sampling = config.rollout.sampling.model_copy(update={"max_new_tokens": 3})
    assert len(worker.generate(["1 + 1 ="], sampling, seed=0, policy=policies["solver"])) == 1
    worker.load_policy(policies["verifier"])  # another driver's load (the same model kind)
    with pytest.raises(PolicyMismatch, match=r"asked to generate from .*/solver, but it holds .*/verifier"):
        worker.generate(["1 + 1 ="], sampling, seed=0, policy=policies["solver"])
    assert worker.status()["policy"] == policies["verifier"].artifact


def test_a_pool_the_cluster_cannot_grant_says_so_and_leaves_nothing(local_ray, tmp_path, monkeypatch, capsys):
    """Patience for GPUs (issue 29 §2): the wait for the pool's slots prints what the
    cluster has, gives up after ``ray.placement_timeout_s`` with a message that says what
    to do, removes the placement group it created and hands the lease on."""
    import drmas.generation.pool as pool_module
    from drmas.generation.named_pool import named_placement_group
    from drmas.generation.pool import PoolNotReady

    monkeypatch.setattr(pool_module, "SLOTS_SAY_EVERY_S", 0.5)
    config = load_config(CONFIGS / "math_tiny.yaml", [*SMALL, "ray.pool_size=3", "ray.placement_timeout_s=2"])
    store = Store(str(tmp_path / "store"))
    with pytest.raises(
        PoolNotReady, match=r"3 slot\(s\) of pool_slot were not granted within .*=2 s; the cluster has 1"
    ):
        RayPool(config, store, threads=1, run=("lease-test", "cold"))
    said = [line for line in capsys.readouterr().out.splitlines() if "waiting" in line]
    assert len(said) >= 2 and "the cluster has 1 pool_slot" in said[0]
    assert named_placement_group(pool_name("lease-test", "cold")) is None
    assert lease_status("lease-test", "cold")["holder"] is None
    free_pool("lease-test", "cold")


def test_a_worker_keeps_only_the_policy_version_it_holds_in_its_cache(tmp_path):
    """Pod disk sizing (issue 28 §6): the policy cache would keep every version ever loaded
    on a node. After a load only the version held is left of the worker's group; another
    group's versions and a download in progress (``.tmp-``) are not its to remove."""
    config = load_config(CONFIGS / "math_tiny.yaml", [*SMALL, f"store.root={tmp_path / 'store'}"])
    store = Store.from_config(config.store)
    policies = init_policies(config, store, "run")
    cache = tmp_path / "cache"
    worker = WorkerGroupRuntime("solver", store.settings(), cache_dir=str(cache), cache_scope="pool-a", threads=1)
    worker.load_policy(policies["solver"])
    (first,) = (cache / "pool-a").iterdir()
    others = [cache / "pool-a" / "verifier-0123456789abcdef", cache / "pool-a" / f"{first.name}.tmp-42"]
    for folder in others:
        folder.mkdir()
    worker.load_policy(policies["verifier"])
    held = cache / "pool-a" / f"solver-{worker.version}"
    assert worker.version is not None and held.name != first.name
    assert sorted((cache / "pool-a").iterdir()) == sorted([held, *others])
    assert (held / "config.json").is_file()


def test_pools_of_one_run_name_in_two_stores_never_prune_each_others_cache(tmp_path):
    """The same experiment and run id in two stores (two users, two tests) on one node: each
    pool's workers prune only their own cache folder, so the other's policy stays loadable
    (a shared folder lost a running pool's policy: CI of 0cbec54)."""
    cache = tmp_path / "cache"
    workers = []
    for seed, name in enumerate(("first", "second")):  # different policies: different versions
        config = load_config(
            CONFIGS / "math_tiny.yaml", [*SMALL, f"store.root={tmp_path / name}", f"experiment.seed={seed}"]
        )
        store = Store.from_config(config.store)
        scope = policy_cache_scope(pool_name("exp", "k"), store.settings())
        worker = WorkerGroupRuntime("solver", store.settings(), cache_dir=str(cache), cache_scope=scope, threads=1)
        worker.load_policy(init_policies(config, store, "k")["solver"])
        workers.append((worker, cache / scope))
    assert workers[0][1] != workers[1][1]
    for worker, folder in workers:
        assert (folder / f"solver-{worker.version}" / "config.json").is_file()
