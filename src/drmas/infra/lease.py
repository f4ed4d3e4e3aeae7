"""One writer per run: a lease held in the store while a process writes a run.

Two processes writing the same run (``drmas run --resume R`` started while R still runs,
a Kubeflow retry of a task whose first attempt is still alive) would write the same
artifacts at once: their manifests keep them from being silently mixed, but work is
wasted and one of them fails with a misleading "no complete artifact". So a writer holds
a lease in the run's folder, ``{experiment}/{run_id}/_LEASE.json``, as the pool's named
actors hold the run on Ray::

    with RunLease(store, experiment, run_id):          # the embedded runner: the whole run
        ...                                            # every write checks the lease first

The lease lists its *holders*: each with an owner id (a uuid per acquisition), host, pid,
what it writes (its *scope*), when it started and its last heartbeat. A heartbeat thread
renews the holder every few seconds (a quarter of the timeout, at most 5 s) and it leaves
on exit, also on an exception. A holder whose heartbeat is older than its timeout
(``store.lease_timeout_s``) is taken for dead (a SIGKILLed process leaves its holder
behind) and is taken over, with a warning naming it. On the holder's own machine (same
kernel boot and pid namespace) a holder whose process has ended (its pid is gone, a zombie,
or another process) is taken over at once: ``drmas run --resume`` right after a crash or a
kill need not wait out the timeout. An acquirer that finds a live holder
in its way gets RunBusy, naming that holder (host, pid, owner), since when it holds the
run, and how long until it counts as stale.

Scopes: who excludes whom.
  * The embedded runner (``drmas run``, ``drmas rerun``) holds the scope ``run``: the whole
    run. It excludes every other holder, and is refused at once while any other is alive
    (a person is at the terminal; the message says when the holder would count as stale).
  * A Kubeflow task (``drmas.stages.io.reuse_or_compute``) holds the scope of the one stage
    output it writes (e.g. ``exp/r/iter-000003/policy/solver``). A pipeline runs one task
    per run at a time, except the updates of the worker groups, which run in parallel and
    write different outputs: they hold different scopes and never refuse each other. A task
    is refused by the embedded runner and by a live holder of its own output: a retry of a
    task whose first attempt is still alive, or the same stage of a second pipeline run of
    the same run. A task *waits* for such a holder (for twice the timeout) rather than
    failing at once: a retry whose first attempt died finds the dead holder and takes it
    over once it is stale, and a task that waited for a live one then finds its output
    cached (the cache check runs holding the lease) and does no work again.
  Why not one lease per pipeline run that all its tasks share: a task cannot tell a dead
  sibling attempt from a live one by the pipeline's id, so a retry would join a live first
  attempt; and the components would all need the pipeline's id as a new parameter.

Race-safety: the lease document is changed only by compare-and-swap, read it, change it,
write it back only if nobody wrote in between, else again. On S3 that is a conditional
put (``If-None-Match: *`` to create, ``If-Match: <etag>`` to change), which AWS S3 and
SeaweedFS (4.x, the tests' server; checked with 12 simultaneous writers, exactly one won
each of 80 rounds) refuse with 412 when the object changed; a put retried after a lost
reply counts as done when the object holds exactly what it wrote. On a local store, the
read-change-write runs under an exclusive ``flock`` of ``_LEASE.json.lock`` and the
document is replaced by an atomic rename. So of two acquirers, or of two takers of a stale
holder, exactly one wins.

A holder that lost its lease (its heartbeat stopped, e.g. the process was paused, and
another took the run over) must stop writing: while a lease is held, the store calls its
``check()`` before it opens an artifact, before each file and before the manifest
(``Store.write_guard``), and ``check()`` raises RunBusy once the renewal found another
owner, or when no renewal has succeeded for longer than the timeout (then another process
may already hold the run). A fenced writer leaves the artifact alone: it may be the new
holder's. Writes by other processes (Ray actors, torchrun ranks, warm-start workers) are
not fenced themselves; their driver is, at its next write.

What remains: staleness is judged by the holder's wall-clock heartbeat, so hosts' clocks
must agree to well within the timeout; and a process paused between a ``check()`` and its
write (a window of one file) can still write after losing the lease, which the manifests
then catch (a reader refuses files that do not match their manifest).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import socket
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from drmas.infra.store import CorruptArtifact, Store, StoreError, replace_atomically

__all__ = ["LEASE_FILE", "RUN_SCOPE", "Holder", "RunBusy", "RunLease", "stage_lease"]

LEASE_FILE = "_LEASE.json"
LEASE_FORMAT = "drmas.lease/1"
RUN_SCOPE = "run"
"""The scope of the embedded runner: the whole run, exclusive of every other holder."""
LONGEST_HEARTBEAT_S = 5.0
STAGE_WAIT_TIMEOUTS = 2.0
"""A Kubeflow task waits this many lease timeouts for a busy output before it gives up:
long enough for a dead first attempt's holder to go stale and be taken over."""

log = logging.getLogger(__name__)


class RunBusy(StoreError):
    """Another live process holds the run (or the part of it this one would write), or this
    process lost its lease to another: it must not write. The message names the holder."""


@dataclass(frozen=True)
class Holder:
    """One process writing a run, as the lease records it."""

    owner: str
    host: str
    pid: int
    scope: str
    started_at: float
    heartbeat_at: float
    timeout_s: float
    machine: str
    """The kernel boot and pid namespace the pid belongs to ("" where /proc is missing)."""
    process_start: str
    """The process's start time (clock ticks since boot): a reused pid has another."""

    def dead(self, now: float) -> bool:
        """No heartbeat for longer than its timeout, or its process is known to have ended."""
        return now - self.heartbeat_at > self.timeout_s or self.ended_here()

    def ended_here(self) -> bool:
        """Whether its process has ended, as far as this machine can tell (only its own)."""
        return bool(self.machine) and self.machine == _MACHINE and _process_start(self.pid) != self.process_start

    def blocks(self, scope: str) -> bool:
        """Whether this holder keeps another from taking ``scope`` (while it is alive)."""
        return RUN_SCOPE in (scope, self.scope) or scope == self.scope

    def describe(self, now: float) -> str:
        what = "the whole run" if self.scope == RUN_SCOPE else self.scope
        return (
            f"pid {self.pid} on {self.host} (owner {self.owner}), writing {what} since "
            f"{_clock(self.started_at)}, last heartbeat {max(0.0, now - self.heartbeat_at):.0f} s ago"
        )


class LeaseFile(Protocol):
    """The lease document in the store, changed by compare-and-swap."""

    where: str

    def read(self) -> tuple[bytes, str] | None:
        """The document and its version token (None: there is none)."""

    def write(self, data: bytes, token: str | None) -> bool:
        """Write ``data`` if the document is still at version ``token`` (None: only if
        there is none); False when another writer came first."""


class RunLease:
    """``with RunLease(store, experiment, run_id, scope): ...`` holds the run (module doc)."""

    def __init__(
        self,
        store: Store,
        experiment: str,
        run_id: str,
        scope: str = RUN_SCOPE,
        wait_s: float = 0.0,
        timeout_s: float | None = None,
    ) -> None:
        self.store, self.run, self.scope, self.wait_s = store, f"{experiment}/{run_id}", scope, wait_s
        self.timeout_s = store.lease_timeout_s if timeout_s is None else timeout_s
        self.heartbeat_s = min(LONGEST_HEARTBEAT_S, self.timeout_s / 4)
        self.owner = uuid.uuid4().hex
        self.file = _lease_file(store, f"{self.run}/{LEASE_FILE}")
        self._lost: str | None = None
        self._renewed_at = 0.0
        self._renew_error = ""
        self._renewing = threading.Lock()
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self._outer_guard: Callable[[], None] | None = None

    def __enter__(self) -> RunLease:
        self.acquire()
        self._outer_guard, self.store.write_guard = self.store.write_guard, self.check
        self._heartbeat = threading.Thread(target=self._beat, name=f"lease {self.run}", daemon=True)
        self._heartbeat.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join()
        self.store.write_guard = self._outer_guard
        try:
            self._transact(self._without_me)
        except StoreError as error:  # it goes stale instead; never hide the body's own error
            log.warning(
                "run %s: could not release its lease (%s); it counts as stale after %.0f s",
                self.run,
                error,
                self.timeout_s,
            )

    # ----------------------------------------------------------------------------------

    def acquire(self) -> None:
        """Become a holder; wait up to ``wait_s`` for a live holder in the way to leave or
        go stale, then RunBusy. Stale holders are dropped, with a warning naming them."""
        deadline = time.monotonic() + self.wait_s
        while in_the_way := self._try_to_join():
            left = deadline - time.monotonic()
            if left <= 0:
                raise RunBusy(self._busy(in_the_way[0], time.time()))
            time.sleep(min(self.heartbeat_s, left))

    def _try_to_join(self) -> list[Holder]:
        """One attempt to become a holder; returns the live holders in the way (none: done)."""
        started, now = time.monotonic(), time.time()
        me = Holder(
            self.owner,
            socket.gethostname(),
            os.getpid(),
            self.scope,
            now,
            now,
            self.timeout_s,
            _MACHINE,
            _process_start(os.getpid()) or "",
        )
        in_the_way: list[Holder] = []

        def admit(holders: dict[str, Holder]) -> dict[str, Holder] | None:
            alive = {scope: holder for scope, holder in holders.items() if not holder.dead(now)}
            in_the_way[:] = [holder for holder in alive.values() if holder.blocks(self.scope)]
            return None if in_the_way else {**alive, self.scope: me}

        before = self._transact(admit)
        if not in_the_way:
            self._renewed_at = started
            for gone in (holder for holder in before.values() if holder.dead(now)):
                why = "its process has ended" if gone.ended_here() else "its heartbeat had stopped"
                log.warning("run %s: took over from a dead holder (%s): %s", self.run, why, gone.describe(now))
        return in_the_way

    def check(self) -> None:
        """RunBusy if this process may no longer write the run: another took its lease
        over, or no renewal succeeded for longer than the timeout (one is tried now)."""
        if self._lost is None and time.monotonic() - self._renewed_at > self.timeout_s:
            self._renew()
        if self._lost is not None:
            raise RunBusy(self._lost)
        silent = time.monotonic() - self._renewed_at
        if silent > self.timeout_s:
            raise RunBusy(
                f"run {self.run}: could not renew this process's lease for {silent:.0f} s "
                f"({self._renew_error}); another process may hold the run now, so this one stops writing"
            )

    # ----------------------------------------------------------------------------------

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s) and self._lost is None:
            self._renew()

    def _renew(self) -> None:
        with self._renewing:
            started, now = time.monotonic(), time.time()
            found: list[Holder | None] = []

            def renewed(holders: dict[str, Holder]):
                found[:] = [holders.get(self.scope)]
                if found[0] is None or found[0].owner != self.owner:
                    return None
                return {**holders, self.scope: replace(found[0], heartbeat_at=now)}

            try:
                self._transact(renewed)
            except StoreError as error:
                self._renew_error = str(error)
                log.warning("run %s: could not renew its lease: %s", self.run, error)
                return
            if found[0] is not None and found[0].owner == self.owner:
                self._renewed_at = started
                return
            taker = f"{found[0].describe(now)} took it over" if found[0] else "its holder entry is gone"
            self._lost = (
                f"run {self.run}: this process (owner {self.owner}) lost its lease: {taker} after this "
                f"process's heartbeat had stopped for over {self.timeout_s:g} s; it stops writing"
            )
            log.error(self._lost)

    def _without_me(self, holders: dict[str, Holder]) -> dict[str, Holder] | None:
        mine = holders.get(self.scope)
        if mine is None or mine.owner != self.owner:
            return None
        return {scope: holder for scope, holder in holders.items() if scope != self.scope}

    def _transact(self, change: Callable[[dict[str, Holder]], dict[str, Holder] | None]) -> dict[str, Holder]:
        """Read the holders, ``change`` them (None: leave the document as it is) and write
        them back unless another writer came first, then again from the read. Returns the
        holders as read before the change that was written."""
        while True:
            current = self.file.read()
            holders = _parse(current[0], self.file.where) if current else {}
            changed = change(holders)
            if changed is None or self.file.write(_encode(changed), current[1] if current else None):
                return holders

    def _busy(self, holder: Holder, now: float) -> str:
        left = holder.heartbeat_at + holder.timeout_s - now
        return (
            f"run {self.run} is being written by another process: {holder.describe(now)}. "
            f"It counts as stale once its heartbeat is {holder.timeout_s:g} s old "
            f"(in {max(0.0, left):.0f} s if that process is dead); then it is taken over"
        )


def stage_lease(store: Store, path: str) -> RunLease:
    """The lease a Kubeflow task holds while it writes the stage output at ``path`` (a path
    inside a run: ``{experiment}/{run_id}/...``); it waits for a busy output (module doc)."""
    parts = path.strip("/").split("/")
    if len(parts) < 3:
        raise ValueError(f"stage output {path!r} is not inside a run ({{experiment}}/{{run_id}}/...)")
    return RunLease(
        store, parts[0], parts[1], scope="/".join(parts), wait_s=STAGE_WAIT_TIMEOUTS * store.lease_timeout_s
    )


# --------------------------------------------------------------------------------------
# the document and where it lives
# --------------------------------------------------------------------------------------


def _encode(holders: dict[str, Holder]) -> bytes:
    document = {"format": LEASE_FORMAT, "holders": {scope: asdict(h) for scope, h in sorted(holders.items())}}
    return json.dumps(document, indent=2, sort_keys=True).encode()


def _parse(data: bytes, where: str) -> dict[str, Holder]:
    try:
        document = json.loads(data)
        if document.get("format") != LEASE_FORMAT:
            raise ValueError(f"format is {document.get('format')!r}, expected {LEASE_FORMAT!r}")
        return {scope: Holder(**fields) for scope, fields in document["holders"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise CorruptArtifact(
            f"{where}: unreadable run lease ({error}); delete it if no process is writing the run"
        ) from None


def _machine() -> str:
    """This kernel's boot and pid namespace: where a pid names the same process ("" where
    processes cannot be looked up in /proc: then only the heartbeat tells)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""
    return f"{boot}/{namespace}" if _process_start(os.getpid()) else ""


def _process_start(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot); None if it is gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


_MACHINE = _machine()


def _clock(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(seconds))


def _lease_file(store: Store, relative: str) -> LeaseFile:
    if store.is_s3:
        return S3LeaseFile(store, relative)
    return LocalLeaseFile(Path(store.root) / relative)


class LocalLeaseFile:
    """The lease in a local folder: read-change-write under an exclusive ``flock`` of a
    lock file beside it (released by the kernel when its holder dies), replaced atomically."""

    def __init__(self, path: Path) -> None:
        self.path, self.where = path, str(path)
        self.lock = path.with_name(f"{path.name}.lock")

    def read(self) -> tuple[bytes, str] | None:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as error:
            raise StoreError(f"{self.where}: cannot read the run lease ({error.strerror or error})") from None
        return data, hashlib.sha256(data).hexdigest()

    def write(self, data: bytes, token: str | None) -> bool:
        try:
            with self._locked():
                current = self.read()
                if (current[1] if current else None) != token:
                    return False
                replace_atomically(str(self.path), data)
                return True
        except OSError as error:
            raise StoreError(f"{self.where}: cannot write the run lease ({error.strerror or error})") from None

    @contextmanager
    def _locked(self) -> Iterator[None]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.lock, "a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            yield


_S3_CLIENTS: weakref.WeakKeyDictionary[Store, Any] = weakref.WeakKeyDictionary()
"""The boto3 client of each open S3 store (boto3 clients are thread-safe)."""


class S3LeaseFile:
    """The lease as an S3 object, changed by conditional puts (ETag as the version)."""

    CONFLICTS = ("PreconditionFailed", "ConditionalRequestConflict")
    """412: the object changed (or exists, for If-None-Match); 409: a concurrent
    conditional write to the same key (AWS)."""

    def __init__(self, store: Store, relative: str) -> None:
        import boto3  # noqa: PLC0415  (only S3 stores need it)
        from botocore.config import Config  # noqa: PLC0415
        from botocore.exceptions import BotoCoreError, ClientError  # noqa: PLC0415

        bucket, _, prefix = store.base.partition("/")
        self.bucket, self.key = bucket, "/".join(part for part in (prefix, relative) if part)
        self.where, self.endpoint = store.uri(relative), store.endpoint or "AWS"
        self.failures = (ClientError, BotoCoreError)
        if store not in _S3_CLIENTS:  # one per store: making one takes a good part of a second
            options: dict[str, Any] = {"retries": {"max_attempts": 3, "mode": "standard"}, "connect_timeout": 5}
            if store.endpoint:  # MinIO, SeaweedFS: buckets are addressed by path, not by host name
                options["s3"] = {"addressing_style": "path"}
            _S3_CLIENTS[store] = boto3.session.Session().client(
                "s3", endpoint_url=store.endpoint, region_name=store.region, config=Config(**options)
            )
        self.client = _S3_CLIENTS[store]

    def read(self) -> tuple[bytes, str] | None:
        try:
            reply = self.client.get_object(Bucket=self.bucket, Key=self.key)
            return reply["Body"].read(), reply["ETag"]
        except self.failures as error:
            if _error_code(error) in ("NoSuchKey", "404"):
                return None
            raise self._failure(error) from None

    def write(self, data: bytes, token: str | None) -> bool:
        condition = {"IfNoneMatch": "*"} if token is None else {"IfMatch": token}
        try:
            self.client.put_object(
                Bucket=self.bucket, Key=self.key, Body=data, ContentType="application/json", **condition
            )
            return True
        except self.failures as error:
            if _error_code(error) not in self.CONFLICTS:
                raise self._failure(error) from None
        current = self.read()  # a put retried after its reply was lost finds its own bytes
        return current is not None and current[0] == data

    def _failure(self, error: Exception) -> StoreError:
        """The failure as a StoreError naming the endpoint and the lease (never the keys)."""
        code = _error_code(error)
        if code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
            return StoreError(
                f"S3 at {self.endpoint} denied access to {self.where}: "
                "check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
            )
        return StoreError(f"S3 at {self.endpoint}: cannot read or write the run lease {self.where}: {error}")


def _error_code(error: Exception) -> str:
    """The S3 error code of a botocore ClientError ("" for anything else)."""
    response = getattr(error, "response", None)
    return str(response.get("Error", {}).get("Code", "")) if isinstance(response, dict) else ""
