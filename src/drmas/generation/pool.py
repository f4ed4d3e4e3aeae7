"""The shared pool on Ray: ``ray.pool_size`` slots, and on each slot one worker per worker
group that runs there, holding both its inference engine and its training shard.

Slots are the bundles of one placement group (a GPU each on a cluster, asked for with
``num_gpus``; a custom resource such as ``pool_slot`` stands in for accelerators on CPU),
as in the reference code, where every model shares the same GPUs. A worker group runs on
all slots by default (``ray.slots`` may partition them); its workers on one slot share it
with the other groups' workers there (each asks for 1/k of the slot).

- **Rollout.** A group's batched prompts are split over its workers (data-parallel
  generation), one seed per request, results in request order. At most
  ``ray.max_resident`` groups' engines are resident; the least recently used is offloaded
  before another is made resident, so N models fit where fewer would.
- **Update.** ``train`` runs a stage's per-rank function in every worker of the group at
  once: the workers are the ranks of the group's process group (gloo on CPU; nccl for GPU
  tensors), the engines on the group's slots release their memory first, and the function
  hands the new weights to each worker's engine in memory. No update runs in a driver.
- **A pool that outlives its stages.** A run's pool (``run`` given) is named and detached:
  its placement group and workers are found again, warm, by the next stage of the run,
  embedded or a Kubeflow task joining the cluster; ``free_pool`` (``drmas pool down``, the
  end of a run, or ``ray.idle_timeout_s`` without a call) removes it. A pool without a run
  (``drmas eval``) lives as long as the object.
- **One driver at a time.** A run's pool object holds the pool's lease from before it looks
  up or creates the pool until it is closed (``drmas.generation.named_pool``); a second
  driver waits, saying who holds it. Every generate call names the policy it expects, and a
  worker holding another refuses (``PolicyMismatch``): a stage never mixes two policies.

Ray starts locally by default (bound to 127.0.0.1) and joins a cluster when
``ray.address`` is set (e.g. the KubeRay head service): ``drmas.generation.ray_session``.
This module imports Ray at its top, as everything that drives the pool needs it (the
runner, the rollout, update and evaluation stages); ``PoolOnDemand`` defers starting it.

A worker that dies (its process killed, its node lost) is restarted by Ray (up to
``ACTOR_RESTARTS`` times per pool); the pool sees the failed call (or the restarted
worker's ``PolicyNotLoaded``), reloads the policy the worker held and repeats the call.
Requests are seeded one by one, so the repeated call returns what the first would have:
the stage completes as if nothing happened. A worker lost during an update takes its
whole group's process group down with it: the group's workers are rebuilt from the store
(the source of truth) and the update runs again; its result is the undisturbed one. Past
the limit the call fails with ``WorkerGroupDied`` naming the worker group, and the stage
writes nothing.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from drmas.config import DrmasConfig, SamplingConfig
from drmas.generation.named_pool import (
    NAMESPACE,
    free_pool,
    named_placement_group,
    pool_lease,
    pool_name,
    run_workers,
    worker_name,
)
from drmas.generation.ray_session import ray_session, slot_request
from drmas.generation.workers import GenerationResult, PolicyNotLoaded, WorkerGroupRuntime
from drmas.infra.cpus import cpu_threads
from drmas.infra.layout import PolicyRef
from drmas.infra.progress import Mirror
from drmas.infra.store import Store, StoreSettings

__all__ = [
    "ACTOR_RESTARTS",
    "HeldLease",
    "PoolBusy",
    "PoolLeaseLost",
    "PoolNotReady",
    "PoolOnDemand",
    "RayPool",
    "WorkerGroupDied",
    "policy_cache_scope",
    "wait_for_slots",
]

log = logging.getLogger("drmas")
ACTOR_RESTARTS = 3
"""How many times, per pool, a dead worker-group actor is restarted before a stage fails."""
ACTOR_RESTART_TIMEOUT_S = 120.0
"""How long to wait for Ray to bring a dead actor back (it reloads torch and the model)."""
COLLECTIVE_TIMEOUT_S = 600.0
"""How long a rank of an update waits for the others in a collective before failing."""
PROGRESS_GROUP = "progress"
"""The workers' concurrency group (a thread of its own) in which the pool asks how far an
update is while the default group runs it."""
PROGRESS_POLL_S = 2.0
"""How often the pool asks a training worker how far it is (``drmas.infra.progress``)."""
SLOTS_SAY_EVERY_S = 30.0
"""How often a stage waiting for the pool's slots says what the cluster has."""
LEASE_STALE_S = 60.0
"""A driver of a run's pool silent (no heartbeat) for this long is taken for dead (a
killed task), and the next driver takes the pool's lease."""
LEASE_WAIT_S = 3600.0
"""How long a driver waits for the pool's lease while another, live, holds it."""
LEASE_SAY_EVERY_S = 30.0
"""How often a waiting driver says whom it waits for."""


def policy_cache_scope(prefix: str, store: StoreSettings) -> str:
    """The policy cache folder of a pool's workers: the pool's name and its store's.

    A pool prunes its own folder (``WorkerGroupRuntime._prune_cache``), so no two pools may
    share one; a run's name alone is not unique on a node (the same experiment and run id
    in two stores, as two users' or two tests' runs are)."""
    where = hashlib.sha256(f"{store.endpoint}|{store.root}".encode()).hexdigest()[:12]
    return f"{prefix}.{where}"


class WorkerGroupDied(RuntimeError):
    """A worker group's actor died more often than ``ACTOR_RESTARTS`` allows."""


class PoolNotReady(RuntimeError):
    """The cluster did not grant the pool's slots within ``ray.placement_timeout_s``."""


def wait_for_slots(placement, resource: str, slots: int, timeout_s: float) -> None:
    """Wait until ``placement`` (the pool's ``slots`` bundles of ``resource``) is granted,
    saying every ``SLOTS_SAY_EVERY_S`` what the cluster has meanwhile: a cold GPU scale-up
    takes minutes, and a silent wait looks hung."""
    ready, started = placement.ready(), time.monotonic()
    while True:
        waited = time.monotonic() - started
        done, _ = ray.wait([ready], timeout=max(0.0, min(SLOTS_SAY_EVERY_S, timeout_s - waited)))
        if done:
            ray.get(done[0])
            return
        waited = time.monotonic() - started
        total = ray.cluster_resources().get(resource, 0.0)
        free = ray.available_resources().get(resource, 0.0)
        state = f"the cluster has {total:g} {resource} ({free:g} free)"
        if waited >= timeout_s:
            raise PoolNotReady(
                f"the pool's {slots} slot(s) of {resource} were not granted within ray.placement_timeout_s="
                f"{timeout_s:g} s; {state}. Scale the GPU worker group up first (see the README's cluster "
                "section), or raise the timeout"
            )
        print(f"drmas: waiting {waited:.0f} s for the pool's {slots} slot(s) of {resource}; {state}", flush=True)


class PoolBusy(RuntimeError):
    """Another driver held the run's pool for longer than this one could wait."""


class PoolLeaseLost(RuntimeError):
    """This driver's lease on the run's pool went to another (it was silent too long, or
    the pool was freed): it stops using the pool."""


class HeldLease:
    """This driver's hold on a run's pool lease: taken (waiting while another live driver
    holds it), renewed by a heartbeat thread, released when the pool object is closed."""

    def __init__(self, prefix: str, stale_after_s: float = LEASE_STALE_S, wait_s: float = LEASE_WAIT_S) -> None:
        self.prefix, self.stale_after_s = prefix, stale_after_s
        self.holder = f"{socket.gethostname()}/pid {os.getpid()}/{uuid.uuid4().hex[:6]}"
        self.actor = pool_lease(prefix)
        self.lost, self.stopped = threading.Event(), threading.Event()
        self._take(wait_s)
        threading.Thread(target=self._heartbeat, name="drmas-pool-lease", daemon=True).start()

    def _take(self, wait_s: float) -> None:
        started = said = time.monotonic()
        while (holder := ray.get(self.actor.acquire.remote(self.holder, self.stale_after_s))) is not None:
            waited = time.monotonic() - started
            if waited > wait_s:
                raise PoolBusy(
                    f"the run's pool {self.prefix} has been driven by {holder} for the {wait_s:.0f} s this "
                    "driver waited; see `drmas pool status`"
                )
            if time.monotonic() - said >= LEASE_SAY_EVERY_S:
                print(f"drmas: waiting {waited:.0f} s for the run's pool: {holder} drives it", flush=True)
                said = time.monotonic()
            time.sleep(min(1.0, self.stale_after_s / 4))

    def _heartbeat(self) -> None:
        while not self.stopped.wait(self.stale_after_s / 4):
            try:
                held = ray.get(self.actor.renew.remote(self.holder), timeout=self.stale_after_s / 2)
            except ray.exceptions.GetTimeoutError:
                continue  # the cluster is slow to answer: the next beat tries again
            except ray.exceptions.RayError:
                held = False  # the lease actor is gone: the pool was freed
            if not held:
                self.lost.set()
                return

    def check(self) -> None:
        """Raise when this driver no longer holds the pool (before every use of it)."""
        if self.lost.is_set():
            raise PoolLeaseLost(
                f"this driver ({self.holder}) lost the lease on the run's pool {self.prefix} (silent for over "
                f"{self.stale_after_s:.0f} s, or the pool was freed); the stage stopped and wrote nothing"
            )

    def release(self) -> None:
        self.stopped.set()
        try:
            ray.get(self.actor.release.remote(self.holder), timeout=30)
        except ray.exceptions.RayError:
            pass  # the pool was freed: nothing to release


class RayPool:
    """The pool's workers, the residency scheduler and the data-parallel update. Use as a
    context manager; ``run=(experiment, run_id)`` names it for the run (see the module)."""

    def __init__(
        self,
        config: DrmasConfig,
        store: Store,
        cache_dir: Path | None = None,
        threads: int | None = None,
        run: tuple[str, str] | None = None,
    ) -> None:
        self.config = config
        self.store_settings = store.settings()
        self.cache_dir = str(cache_dir) if cache_dir else None
        self.run = run
        self.prefix = pool_name(*run) if run else f"drmas.pool-{uuid.uuid4().hex[:8]}"
        self.max_resident = config.ray.max_resident
        self.resident: OrderedDict[str, None] = OrderedDict()  # least recently used first
        self.loads = 0
        self.restarts = 0
        self.started = 0
        """Workers this pool object created (the others it found warm)."""
        self.policies: dict[str, PolicyRef] = {}
        self.formed: set[str] = set()
        self.groups = {group.name: group for group in config.worker_groups()}
        self.slots = {wg: config.slots_of(wg) for wg in self.groups}
        self.threads = threads or (None if config.ray.address else cpu_threads())
        """Torch threads of the workers on one slot; None on a cluster, where each worker
        reads its own pod's CPU limit (the driver's pod says nothing about theirs)."""
        self.lease = HeldLease(self.prefix) if run else None
        try:
            self.placement = self._placement()
            self.workers = {wg: [self._worker(wg, slot) for slot in self.slots[wg]] for wg in self.groups}
            self._adopt_warm_state()
        except BaseException:
            if self.lease is not None:  # the next driver need not wait for this one's silence
                self.lease.release()
            raise

    # -- building --------------------------------------------------------------------------

    def _placement(self):
        placement = named_placement_group(self.prefix) if self.run else None
        created = placement is None
        if created:
            bundles = [{self.config.ray.pool_resource: 1.0}] * self.config.ray.pool_size
            detached = "detached" if self.run else None
            placement = placement_group(bundles, strategy="PACK", name=self.prefix, lifetime=detached)
        try:
            wait_for_slots(
                placement, self.config.ray.pool_resource, self.config.ray.pool_size, self.config.ray.placement_timeout_s
            )
        except PoolNotReady:
            if created:  # a pending group would hold its place in the queue for nobody
                remove_placement_group(placement)
            raise
        return placement

    def _worker(self, wg: str, slot: int):
        """The worker of ``wg`` on ``slot``: found by name when the run's pool has it, else
        created (detached for a run's pool, so that it outlives this stage)."""
        name = worker_name(self.prefix, wg, slot)
        if self.run:
            try:
                return ray.get_actor(name, namespace=NAMESPACE)
            except ValueError:
                pass
        group = self.groups[wg]
        sharing = sum(1 for other in self.slots.values() if slot in other)
        actor_class = ray.remote(concurrency_groups={PROGRESS_GROUP: 1})(WorkerGroupRuntime)
        handle = actor_class.options(
            num_cpus=0,
            **slot_request(self.config.ray.pool_resource, 1.0 / sharing),
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement, placement_group_bundle_index=slot),
            name=name,
            namespace=NAMESPACE,
            lifetime="detached" if self.run else None,
            get_if_exists=bool(self.run),
            max_restarts=ACTOR_RESTARTS,
        ).remote(
            wg,
            self.store_settings,
            engine=self.config.rollout.engine,
            dtype=group.spec.dtype if group.spec else "float32",
            max_prompt_tokens=self.config.rollout.max_prompt_tokens,
            truncation=self.config.rollout.truncation,
            chat_template_kwargs=group.chat_template_kwargs,
            system_prompt=group.system_prompt,
            cache_dir=self.cache_dir,
            cache_scope=policy_cache_scope(self.prefix, self.store_settings),
            slot_resource=self.config.ray.pool_resource,
            threads=max(1, self.threads // len(self.slots[wg])) if self.threads else None,
            relay=True,
        )
        self.started += 1
        if self.run:
            handle.watch_idle.remote(self.config.ray.idle_timeout_s, *self.run)
        return handle

    def _adopt_warm_state(self) -> None:
        """What found workers hold: resident engines, and process groups already formed."""
        if self.started == sum(len(w) for w in self.workers.values()):
            return
        for wg, workers in self.workers.items():
            statuses = ray.get([w.status.remote() for w in workers])
            if all(s["resident"] for s in statuses) and all(s["version"] for s in statuses):
                self._mark_resident(wg)
            if [(s["rank"], s["world"]) for s in statuses] == [(r, len(workers)) for r in range(len(workers))]:
                self.formed.add(wg)
        while len(self.resident) > self.max_resident:
            self._offload(next(iter(self.resident)))

    def __enter__(self) -> RayPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Leave the pool: a run's pool stays for the run's next stage (its lease goes to
        whoever waits); another is removed."""
        if self.lease is not None:
            self.lease.release()
        if not self.run:
            for workers in self.workers.values():
                for worker in workers:
                    ray.kill(worker, no_restart=True)
            remove_placement_group(self.placement)
        self.workers = {}

    # -- rollout ---------------------------------------------------------------------------

    def load(self, policies: dict[str, PolicyRef]) -> None:
        """Point every worker group at its policy version; workers reload only on change.

        Loading makes a worker group resident, so the residency limit holds here too.
        """
        missing = set(self.workers) - set(policies)
        if missing:
            raise ValueError(f"no policy given for worker group(s): {', '.join(sorted(missing))}")
        for wg, policy in policies.items():
            self._make_room(wg)
            self.policies[wg] = policy
            self.loads += max(self._each(wg, "load_policy", policy))
            self._mark_resident(wg)

    def generate(self, wg: str, messages: list[str], sampling: SamplingConfig, seed: int) -> list[GenerationResult]:
        """``messages`` split over the group's workers in order; request i is seeded by
        (``seed``, i) wherever it runs. Results in request order."""
        self._make_resident(wg)
        workers = len(self.workers[wg])
        bounds = [round(len(messages) * k / workers) for k in range(workers + 1)]
        chunks = {i: (bounds[i], messages[bounds[i] : bounds[i + 1]]) for i in range(workers)}
        parts = self._each(
            wg, "generate", sampling=sampling, seed=seed, policy=self.policies.get(wg), per_worker=chunks
        )
        return [result for part in parts for result in part]

    def status(self) -> dict[str, list[dict[str, object]]]:
        """Worker group -> the status of each of its workers (by rank)."""
        return {wg: self._each(wg, "status") for wg in self.workers}

    # -- update ----------------------------------------------------------------------------

    def train(self, wg: str, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(worker, *args)`` in every worker of ``wg`` at once, as the ranks of its
        process group, after the engines on its slots released their memory; returns rank
        0's result. A worker lost meanwhile: the group is rebuilt and ``fn`` runs again."""
        while True:
            if self.lease is not None:
                self.lease.check()
            self._release_slots(wg)
            self._form_group(wg)
            refs = [worker.run.remote(fn, *args) for worker in self.workers[wg]]
            try:
                return _first_failure_or_all(refs, watched=self.workers[wg][0])[0]
            except Exception:
                # A rank whose peer died fails in its collective (gloo: "connection reset")
                # as soon as Ray reports the death, or sooner: ask every rank.
                died = next((e for e in _failures(refs) if isinstance(e, ray.exceptions.RayActorError)), None)
                if died is None:
                    if not _all_done(refs):  # a rank failed alone: the others wait in a collective
                        self._rebuild(wg)
                    raise
                self.restarts += 1
                if self.restarts > ACTOR_RESTARTS:
                    self._give_up(wg, "the update", died)
                log.warning(
                    "worker group %s: a worker died during the update; rebuilding its %d worker(s) from the "
                    "store and updating again (%d/%d)",
                    wg,
                    len(refs),
                    self.restarts,
                    ACTOR_RESTARTS,
                )
                self._rebuild(wg)

    def _release_slots(self, wg: str) -> None:
        """Offload every resident engine on ``wg``'s slots: the update gets their memory."""
        mine = set(self.slots[wg])
        for other in list(self.resident):
            if mine & set(self.slots[other]):
                self._offload(other)

    def _form_group(self, wg: str) -> None:
        """Make the group's workers the ranks of one process group, if they are not yet:
        a file rendezvous when they share a node (nothing listens), else TCP at rank 0."""
        workers = self.workers[wg]
        if wg in self.formed:
            return
        places = ray.get([worker.rendezvous.remote() for worker in workers])
        if len({place["node"] for place in places}) == 1:
            method = f"file://{Path(places[0]['folder']) / f'drmas-pg-{uuid.uuid4().hex}'}"
        else:
            method = f"tcp://{places[0]['ip']}:{places[0]['port']}"
        ray.get(
            [
                worker.join_group.remote(method, rank, len(workers), COLLECTIVE_TIMEOUT_S)
                for rank, worker in enumerate(workers)
            ]
        )
        self.formed.add(wg)

    def _rebuild(self, wg: str) -> None:
        """Replace the group's workers with fresh ones holding its policy (from the store)."""
        for worker in self.workers[wg]:
            ray.kill(worker, no_restart=True)
        self.resident.pop(wg, None)
        self.formed.discard(wg)
        deadline = time.monotonic() + ACTOR_RESTART_TIMEOUT_S
        while self.run and any(worker_name(self.prefix, wg, s) in run_workers(self.prefix) for s in self.slots[wg]):
            if time.monotonic() > deadline:
                raise WorkerGroupDied(f"worker group {wg!r}: its killed workers did not go away")
            time.sleep(0.1)  # a name is free again only once its actor is dead
        self.workers[wg] = [self._worker(wg, slot) for slot in self.slots[wg]]
        if wg in self.policies:
            self._each(wg, "load_policy", self.policies[wg])
            self._each(wg, "offload")

    # -- calls, restarts and residency ----------------------------------------------------

    def _each(self, wg: str, method: str, *args: object, per_worker: dict | None = None, **kwargs: object) -> list:
        """``method`` on every worker of ``wg`` at once (``per_worker``: rank -> (first,
        messages), the generate split); results by rank. A call that fails because its
        worker died is repeated through ``_call``, which brings the worker back."""

        def arguments(rank: int) -> tuple[tuple, dict]:
            if per_worker is None:
                return args, kwargs
            first, messages = per_worker[rank]
            return (messages,), {**kwargs, "first": first}

        if self.lease is not None:
            self.lease.check()
        refs = []
        for rank, worker in enumerate(self.workers[wg]):
            call_args, call_kwargs = arguments(rank)
            refs.append(getattr(worker, method).remote(*call_args, **call_kwargs))
        results = []
        for rank, ref in enumerate(refs):
            try:
                results.append(ray.get(ref))
            except (ray.exceptions.RayActorError, PolicyNotLoaded) as error:
                if isinstance(error, PolicyNotLoaded) and wg not in self.policies:
                    raise  # a caller's mistake, not a restart
                call_args, call_kwargs = arguments(rank)
                results.append(self._call(wg, rank, method, *call_args, **call_kwargs))
        return results

    def _call(self, wg: str, rank: int, method: str, *args: object, **kwargs: object):
        """Call one worker's method; if the worker died, let Ray restart it, bring it back to
        the state the pool believes it is in, and call again."""
        failure: Exception | None = None
        for _ in range(ACTOR_RESTARTS + 2):
            try:
                return ray.get(getattr(self.workers[wg][rank], method).remote(*args, **kwargs))
            except (ray.exceptions.RayActorError, PolicyNotLoaded) as error:
                if isinstance(error, PolicyNotLoaded) and wg not in self.policies:
                    raise
                failure = error
                if self._came_back_empty(wg, rank, method, error):
                    self._restore(wg, rank, method)
        self._give_up(wg, method, failure)

    def _came_back_empty(self, wg: str, rank: int, method: str, error: Exception) -> bool:
        """Wait (bounded) until the worker answers again; True if it is a restarted, empty one."""
        deadline = time.monotonic() + ACTOR_RESTART_TIMEOUT_S
        while True:
            try:
                status = ray.get(self.workers[wg][rank].status.remote(), timeout=ACTOR_RESTART_TIMEOUT_S)
                break
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as again:
                if isinstance(again, ray.exceptions.ActorDiedError) or time.monotonic() > deadline:
                    self._give_up(wg, method, again)
                time.sleep(0.2)
        if status["version"] is not None or wg not in self.policies:
            return False
        self.restarts += 1
        self.formed.discard(wg)  # the restarted worker left its process group
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

    def _give_up(self, wg: str, method: str, error: Exception | None) -> None:
        text = str(error) if error is not None else ""
        reason = text.splitlines()[0][:300] if text else type(error).__name__
        raise WorkerGroupDied(
            f"worker group {wg!r}: its Ray actor died during {method} and could not be brought back "
            f"({self.restarts} restart(s) so far; {reason}); the stage stopped and wrote nothing"
        ) from None

    def _restore(self, wg: str, rank: int, method: str) -> None:
        """Bring a restarted worker back to the state the pool believes it is in: holding
        its policy, and offloaded unless resident (or about to be made so by ``method``)."""
        if method == "load_policy":
            return
        self._call(wg, rank, "load_policy", self.policies[wg])
        if wg not in self.resident and method not in ("offload", "resume"):
            self._call(wg, rank, "offload")

    def _make_resident(self, wg: str) -> None:
        if wg in self.resident:
            self.resident.move_to_end(wg)
            return
        self._make_room(wg)
        self._each(wg, "resume")
        self._mark_resident(wg)

    def _make_room(self, wg: str) -> None:
        while wg not in self.resident and len(self.resident) >= self.max_resident:
            self._offload(next(iter(self.resident)))

    def _offload(self, wg: str) -> None:
        self.resident.pop(wg, None)
        self._each(wg, "offload")

    def _mark_resident(self, wg: str) -> None:
        self.resident[wg] = None
        self.resident.move_to_end(wg)


def _first_failure_or_all(refs: list, watched: Any = None) -> list:
    """Every result, or the first failure as soon as it happens (the other ranks of a
    collective would wait for the failed one until their timeout). Meanwhile the progress
    of ``watched`` (a worker running one of them) is shown here."""
    pending, mirror = list(refs), Mirror()
    try:
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=PROGRESS_POLL_S if watched else None)
            if ready:
                ray.get(ready[0])
            else:
                mirror.show(_progress_of(watched))
    finally:
        mirror.close()
    return ray.get(refs)


def _progress_of(worker: Any) -> list[dict[str, Any]]:
    """What ``worker`` relays of its work's progress; nothing when it cannot say now (it
    is being restarted): progress is for a person watching and never fails a stage."""
    try:
        return ray.get(worker.progress.options(concurrency_group=PROGRESS_GROUP).remote(), timeout=PROGRESS_POLL_S)
    except (ray.exceptions.RayError, ValueError):
        return []


def _failures(refs: list, wait_s: float = 30.0) -> list[Exception]:
    """The errors of the ranks that failed, after waiting (bounded) for every rank to end."""
    ray.wait(refs, num_returns=len(refs), timeout=wait_s)
    failures = []
    for ref in refs:
        try:
            ray.get(ref, timeout=0)
        except ray.exceptions.GetTimeoutError:
            continue  # still running (waiting for a peer): the rebuild stops it
        except Exception as error:
            failures.append(error)
    return failures


def _all_done(refs: list) -> bool:
    _, pending = ray.wait(refs, num_returns=len(refs), timeout=5.0)
    return not pending


class PoolOnDemand:
    """The Ray pool, started on first use: a rerun that recomputes nothing starts no Ray.

    ``run=(experiment, run_id)``: the run's named pool, found warm when an earlier stage
    left it; ``release()`` frees it (the end of the run)."""

    def __init__(
        self, config: DrmasConfig, store: Store, cache_dir: Path | None, run: tuple[str, str] | None = None
    ) -> None:
        self.config, self.store, self.cache_dir, self.run = config, store, cache_dir, run
        self.pool: RayPool | None = None
        self.ray = ExitStack()
        self.release_on_exit = False

    def __call__(self) -> RayPool:
        if self.pool is None:
            self.ray.enter_context(ray_session(self.config, self.cache_dir / "ray" if self.cache_dir else None))
            self.pool = RayPool(
                self.config, self.store, cache_dir=self.cache_dir / "policies" if self.cache_dir else None, run=self.run
            )
            workers = sum(len(group) for group in self.pool.workers.values())
            found = "started" if self.pool.started == workers else "found warm"
            slots = self.config.ray.pool_size
            print(
                f"drmas: pool {found}: {workers} worker(s) on {slots} slot(s), {self.pool.started} started", flush=True
            )
        return self.pool

    def release(self) -> None:
        """Free the run's pool when this object is left (the run is complete)."""
        self.release_on_exit = True

    def __enter__(self) -> PoolOnDemand:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.pool is not None:
            self.pool.close()
            if self.run and self.release_on_exit:
                free_pool(*self.run)
        self.ray.close()
