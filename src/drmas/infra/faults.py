"""Kill points: a run that SIGKILLs itself at a chosen write to the store.

The fault-injection tests need kills at exact, repeatable places inside every stage (a
kill from outside at a random time rarely lands inside a stage that lasts milliseconds).
Every file an artifact writer puts into the store passes through ``reached``; when the
environment names that write, the whole process group of the run is killed with SIGKILL
on the spot, exactly as ``kill -9`` would, Ray workers and update processes included:

    DRMAS_KILL_AT="iter-000001/policy/solver#2"        before the 2nd file of that artifact
    DRMAS_KILL_AT="iter-000001/policy/solver#2~torn"   after writing half of the 2nd file
    DRMAS_KILL_AT="iter-000000/checkpoint#manifest"    after every file, before the manifest

The part before ``#`` matches the end of an artifact's path. Unset, ``reached`` costs one
dictionary lookup per file. A write made by a pool worker (the update's rank 0 writes its
artifacts in a Ray actor) kills the run that started it: the run's process group is named
to its children in ``RUN_GROUP`` when the run leads a session of its own.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

__all__ = ["KILL_AT", "RUN_GROUP", "reached"]

KILL_AT = "DRMAS_KILL_AT"
RUN_GROUP = "DRMAS_KILL_GROUP"


def _name_the_run_group() -> None:
    """A run started in a session of its own (as the tests start the CLI) names its process
    group to the processes it starts (Ray's workers inherit the environment)."""
    if os.environ.get(KILL_AT) and os.getsid(0) == os.getpgid(0) == os.getpid():
        os.environ.setdefault(RUN_GROUP, str(os.getpid()))


_name_the_run_group()


def reached(artifact: str, position: int | str, write_half: Callable[[], None] | None = None) -> None:
    """Kill the run if ``DRMAS_KILL_AT`` names this write of ``artifact``.

    ``position`` is the 1-based index of the file in the artifact, or ``"manifest"``;
    ``write_half`` writes the first half of the file, for a torn write.
    """
    target = os.environ.get(KILL_AT)
    if not target:
        return
    where, _, when = target.partition("#")
    point, _, torn = when.partition("~")
    if not artifact.endswith(where.strip("/")) or point != str(position):
        return
    if torn == "torn" and write_half is not None:
        write_half()
    _kill_run()


def _kill_run() -> None:
    """SIGKILL the run's whole process group when the run has a session of its own (a test
    starts the CLI with ``start_new_session``; its Ray and update processes share it), else
    only this process: never a shell's or a test runner's group. In a process the run
    started (a pool worker), the run's group as the run named it."""
    if named := os.environ.get(RUN_GROUP):
        os.killpg(int(named), signal.SIGKILL)
    group = os.getpgid(0)
    if os.getsid(0) == group:
        os.killpg(group, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)
