"""One writer per run (drmas.infra.lease): real processes racing for a run's lease on a
local store and on the SeaweedFS S3 server, a SIGKILLed holder taken over, a paused one
that lost its lease and is fenced, the scopes of the embedded runner and of Kubeflow
tasks, and ``drmas run --resume R`` / ``drmas rerun`` refused while R is held."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import drmas

from drmas.config import StoreConfig, load_config
from drmas.infra.lease import LEASE_FILE, RUN_SCOPE, RunBusy, RunLease, stage_lease
from drmas.infra.store import CorruptArtifact, Store
from drmas.runner import open_run

TESTS = Path(__file__).resolve().parent
MATH = str(TESTS.parent / "configs" / "math_tiny.yaml")
SHORT_S = 1.5
"""The lease timeout of the tests that wait for a holder to go stale."""


class Writer:
    """A ``tests/leaseholder.py`` process: another writer of ``run``."""

    def __init__(self, store: Store, timeout_s: float, run: str = "exp/r") -> None:
        self.process = subprocess.Popen(
            [sys.executable, str(TESTS / "leaseholder.py"), store.root, store.endpoint or "-", str(timeout_s), run],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent / "src"), str(TESTS)])},
        )
        self.pid = self.process.pid

    def ready(self) -> Writer:
        assert self.read() == "ready", self.process.stderr.read() if self.process.stderr else ""
        return self

    def send(self, command: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()

    def read(self):
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        assert line, f"pid {self.pid} ended: {self.process.stderr.read() if self.process.stderr else ''}"
        return json.loads(line)

    def ask(self, command: str) -> dict:
        self.send(command)
        return self.read()

    def end(self) -> str:
        """Close its stdin (it leaves the lease) and return what it logged."""
        _, errors = self.process.communicate(timeout=30)
        return errors

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.communicate(timeout=30)


@pytest.fixture
def writers():
    """Start writers; every one still running at the end is killed."""
    started: list[Writer] = []

    def start(store: Store, timeout_s: float = SHORT_S, count: int = 1) -> list[Writer]:
        new = [Writer(store, timeout_s) for _ in range(count)]
        started.extend(new)
        return [writer.ready() for writer in new]

    yield start
    for writer in started:
        writer.kill()


def race(writers: list[Writer], command: str = "acquire") -> list[dict]:
    """Send ``command`` to every writer at once (each is ready and waiting), then read."""
    for writer in writers:
        writer.send(command)
    return [writer.read() for writer in writers]


def holders(store: Store, run: str = "exp/r") -> dict:
    """The holders the lease document of ``run`` lists, read as another tool would."""
    lease = RunLease(store, *run.split("/"))
    current = lease.file.read()
    return json.loads(current[0])["holders"] if current else {}


# --------------------------------------------------------------------------------------
# processes racing, on a local store and on S3
# --------------------------------------------------------------------------------------


def test_of_three_processes_racing_for_a_run_exactly_one_gets_it(store, writers):
    racers = writers(store, timeout_s=60.0, count=3)
    answers = race(racers)
    winners = [
        (writer, answer["acquired"]) for writer, answer in zip(racers, answers, strict=True) if "acquired" in answer
    ]
    assert len(winners) == 1, answers
    winner, owner = winners[0]
    host = socket.gethostname()
    for answer in answers:
        if "busy" in answer:
            assert answer["busy"].startswith(
                f"run exp/r is being written by another process: pid {winner.pid} on {host} (owner {owner}), "
                "writing the whole run since "
            ), answer
            # the time left is the timeout less the heartbeat's age, both as the refusal read them
            age, left = re.search(
                r"last heartbeat (\d+) s ago\. It counts as stale once its heartbeat is 60 s old \(in (\d+) s if that",
                answer["busy"],
            ).groups()
            assert abs(int(age) + int(left) - 60) <= 1, answer["busy"]
    assert list(holders(store)) == [RUN_SCOPE] and holders(store)[RUN_SCOPE]["owner"] == owner
    winner.end()
    assert holders(store) == {}, "the holder left the lease when it ended"


def one_winner(takers: list[Writer], answers: list[dict]) -> tuple[Writer, Writer]:
    """The one taker that got the lease and the one refused, naming it."""
    assert sorted(next(iter(answer)) for answer in answers) == ["acquired", "busy"], answers
    winner, loser = (takers[0], takers[1]) if "acquired" in answers[0] else (takers[1], takers[0])
    assert f"pid {winner.pid} " in next(answer["busy"] for answer in answers if "busy" in answer)
    return winner, loser


def test_a_stale_holder_is_taken_over_and_of_two_takers_one_wins(store, writers):
    """A holder whose heartbeat stopped (SIGSTOP: alive but silent, as a process on another
    machine that died looks from here) is waited out for the timeout, then taken over."""
    first, *takers = writers(store, count=3)
    first.ask("acquire")
    os.kill(first.pid, signal.SIGSTOP)
    refused = race(takers)
    assert all("busy" in answer and f"pid {first.pid} " in answer["busy"] for answer in refused), refused
    time.sleep(SHORT_S + 0.2)
    winner, loser = one_winner(takers, race(takers))
    loser.end()
    first.kill()
    assert (
        f"took over from a dead holder (its heartbeat had stopped): pid {first.pid} on {socket.gethostname()}"
        in winner.end()
    )


def test_a_killed_holder_on_this_machine_is_taken_over_at_once(store, writers):
    """SIGKILL runs no exit handler, so the holder stays in the lease; on the machine it ran
    on its pid is seen gone, so a resume right after a crash need not wait out the timeout."""
    first, *takers = writers(store, timeout_s=60.0, count=3)
    first.ask("acquire")
    first.kill()
    winner, loser = one_winner(takers, race(takers))
    loser.end()
    assert (
        f"took over from a dead holder (its process has ended): pid {first.pid} on {socket.gethostname()}"
        in winner.end()
    )


def test_a_paused_holder_that_lost_its_lease_stops_writing(store, writers):
    """SIGSTOP stands for a process that stalls (a paused VM, a long GC): its heartbeat stops,
    another takes the run over, and when it wakes up it must not write."""
    paused, taker = writers(store, count=2)
    paused.ask("acquire")
    os.kill(paused.pid, signal.SIGSTOP)
    try:
        time.sleep(SHORT_S + 0.2)
        assert "acquired" in taker.ask("acquire")
    finally:
        os.kill(paused.pid, signal.SIGCONT)
    fenced = paused.ask("write")
    assert "fenced" in fenced, fenced
    assert f"lost its lease: pid {taker.pid} on {socket.gethostname()}" in fenced["fenced"]
    assert not store.exists("exp/r/iter-000000/rollout"), "the fenced writer wrote nothing"
    assert "lost" in paused.ask("check")
    assert "wrote" in taker.ask("write")
    assert store.exists("exp/r/iter-000000/rollout")
    paused.end()
    assert list(holders(store)) == [RUN_SCOPE], "the one that lost it did not remove the new holder"


# --------------------------------------------------------------------------------------
# scopes: the embedded runner and Kubeflow tasks
# --------------------------------------------------------------------------------------


def test_stage_outputs_of_a_run_are_held_apart_and_the_runner_holds_all(store):
    solver, verifier = "exp/r/iter-000002/policy/solver", "exp/r/iter-000002/policy/verifier"
    with stage_lease(store, solver) as first, stage_lease(store, verifier):
        assert sorted(holders(store)) == [solver, verifier]
        retry = RunLease(store, "exp", "r", scope=solver)  # a second attempt at the same output
        with pytest.raises(RunBusy, match=f"owner {first.owner}\\), writing {solver} since"):
            retry.acquire()
        with pytest.raises(RunBusy, match="writing exp/r/iter-000002/policy/"):
            RunLease(store, "exp", "r").acquire()
    with RunLease(store, "exp", "r") as runner:
        with pytest.raises(RunBusy, match=f"owner {runner.owner}\\), writing the whole run since"):
            RunLease(store, "exp", "r", scope=solver).acquire()
        with RunLease(store, "exp", "other"):  # another run is another lease
            pass
    assert holders(store) == {}


def test_a_stale_holder_is_dropped_with_a_warning_naming_it(store, caplog):
    caplog.set_level(logging.WARNING, logger="drmas.infra.lease")
    stalled = RunLease(store, "exp", "r", timeout_s=0.2)
    stalled.acquire()  # joined, but no heartbeat thread: it goes stale like a killed process
    time.sleep(0.3)
    with RunLease(store, "exp", "r", scope="exp/r/iter-000000/rollout"):
        assert list(holders(store)) == ["exp/r/iter-000000/rollout"]
    assert (
        f"took over from a dead holder (its heartbeat had stopped): pid {os.getpid()} on {socket.gethostname()} "
        f"(owner {stalled.owner})" in caplog.text
    )


def test_a_holder_on_another_machine_counts_only_by_its_heartbeat(store):
    """Its pid means nothing here: it is in the way until its heartbeat is a timeout old."""
    lease = RunLease(store, "exp", "r")
    now = time.time()
    elsewhere = {
        "owner": "f" * 32,
        "host": "node-7",
        "pid": 1,
        "scope": RUN_SCOPE,
        "started_at": now - 600,
        "heartbeat_at": now - 20,
        "timeout_s": 30.0,
        "machine": "other-boot/pid:[1]",
        "process_start": "5",
    }
    document = {"format": "drmas.lease/1", "holders": {RUN_SCOPE: elsewhere}}
    assert lease.file.write(json.dumps(document).encode(), None)
    with pytest.raises(RunBusy, match=r"pid 1 on node-7 ") as busy:
        lease.acquire()
    # The store's round trips take time on a loaded machine: the ages move on, their sum does not.
    found = re.search(r"last heartbeat (\d+) s ago.* \(in (\d+) s if that process is dead\)", str(busy.value))
    assert found is not None, busy.value
    age, left = int(found[1]), int(found[2])
    assert 20 <= age <= 25 and 29 <= age + left <= 31, busy.value
    current = lease.file.read()
    document["holders"][RUN_SCOPE]["heartbeat_at"] = now - 31
    assert current is not None and lease.file.write(json.dumps(document).encode(), current[1])
    with lease:
        assert holders(store)[RUN_SCOPE]["owner"] == lease.owner


def test_a_stage_output_outside_a_run_is_refused(store):
    with pytest.raises(ValueError, match=r"stage output 'exp/iter-000001' is not inside a run"):
        stage_lease(store, "exp/iter-000001")


def test_an_unreadable_lease_is_refused_naming_its_file(tmp_path):
    store = Store(str(tmp_path))
    (tmp_path / "exp" / "r").mkdir(parents=True)
    (tmp_path / "exp" / "r" / LEASE_FILE).write_text("{not json")
    with pytest.raises(CorruptArtifact, match=f"{tmp_path}/exp/r/{LEASE_FILE}: unreadable run lease"):
        RunLease(store, "exp", "r").acquire()


def test_the_lease_timeout_comes_from_the_store_config_and_travels_with_it(tmp_path):
    assert Store(str(tmp_path)).lease_timeout_s == StoreConfig().lease_timeout_s
    store = Store.from_config(StoreConfig(root=str(tmp_path), lease_timeout_s=7.5))
    assert store.settings().lease_timeout_s == 7.5  # Ray actors and KFP tasks open the same store
    assert RunLease(store, "exp", "r").timeout_s == 7.5


# --------------------------------------------------------------------------------------
# the command line
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "command",
    [["run", "--resume", "R"], ["rerun", "--run-id", "R", "--iteration", "0", "--stage", "advantage"]],
    ids=lambda command: command[0],
)
def test_a_second_writer_of_a_running_run_is_refused_with_the_holder(command, tmp_path, capsys):
    """``drmas run`` R holds R's lease while it trains; here a process that holds the lease
    as ``drmas run`` does stands for it (a real training run would take minutes here)."""
    config = load_config(MATH, [f"store.root={tmp_path}"])
    store = Store.from_config(config.store)
    open_run(config, store, "R", resume=False)
    holder = Writer(store, 60.0, run=f"{config.experiment.name}/R").ready()
    try:
        lease_owner = holder.ask("acquire")["acquired"]
        status, _, err = drmas(capsys, command[0], MATH, f"store.root={tmp_path}", *command[1:])
    finally:
        holder.kill()
    assert status == 1
    prefix = f"drmas {command[0]}: " + ("cannot continue run R: " if command[0] == "run" else "")
    assert err.startswith(
        f"{prefix}run math-tiny/R is being written by another process: pid {holder.pid} on "
        f"{socket.gethostname()} (owner {lease_owner}), writing the whole run since "
    ), err
    assert "Traceback" not in err and err.count("\n") == 1
    assert not store.list(f"{config.experiment.name}/R/iter-000000"), "the refused command wrote nothing"
