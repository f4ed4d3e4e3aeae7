"""The CPU threads drmas's torch work may use on this machine."""

from __future__ import annotations

import os


def cpu_threads() -> int:
    """``OMP_NUM_THREADS`` when it is set to a positive number, else every core.

    torch reads the same variable for its own default, so setting it is how a user shares
    one machine between jobs (a test runner with several workers, two runs side by side):
    the pool's workers and the warm starts divide these threads instead of each taking every
    core, which on a small machine makes them several times slower than one thread each."""
    value = os.environ.get("OMP_NUM_THREADS", "")
    if value.strip().isdigit() and int(value) > 0:
        return int(value)
    return os.cpu_count() or 1
