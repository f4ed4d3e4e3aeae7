"""Progress of long work that a person can watch: a tqdm bar on a terminal, and plain lines
when the output is not one (CI, ``make run | tee``, a pod's log), where a bar would be
either invisible (tqdm turns itself off) or a wall of carriage returns.

    with Progress(total=800, desc="warm start solver", unit="step") as progress:
        for step in range(800):
            ...
            progress.update(loss=f"{loss:.3f}")

A plain line says where the work is, how fast it goes now and the latest values given
(``warm start solver: step 120/800 (15%), 2.1 step/s, about 5m24s left, loss 1.234``);
one is printed at most every ``every_s`` seconds, and one at the end, so a quick piece of
work prints one line. With ``final_line=False`` (work inside a step whose end something
else reports, e.g. a rollout inside an iteration, whose line follows) it prints lines only
while it is slow, none at the end. ``total=None``: work of unknown length (a count and a
rate, no share).

A pool worker is a Ray actor: what it prints goes to Ray's log files, not to the console
of the process that drives the run. There ``relay_progress()`` keeps its progress instead,
``relayed()`` hands it to whoever asks (the pool asks while it waits for the worker), and
that process shows it with a ``Mirror``: the same bar or lines as if the work ran there.
"""

from __future__ import annotations

import re
import sys
import time
from typing import Any, TextIO

from tqdm.auto import tqdm

__all__ = ["PLAIN_EVERY_S", "PLAIN_LINE", "Mirror", "Progress", "relay_progress", "relayed"]

PLAIN_EVERY_S = 30.0
"""Seconds between two plain progress lines of one piece of work."""

PLAIN_LINE = re.compile(r"[^:\n]+: [\w-]+ \d+(/\d+ \(\d+%\))?, \S+ [\w-]+/s(, |$)")
"""A plain progress line, as a reader of a process's output finds it (kfp.local's task log)."""

_relay: dict[str, dict[str, Any]] | None = None
"""This process's relayed progress (``relay_progress``): description -> its latest state."""


def relay_progress() -> None:
    """From now on, this process keeps the progress of its work for ``relayed()`` instead
    of showing it (a process whose output nobody watches: a pool worker)."""
    global _relay  # one relay per process, as there is one console per process
    _relay = {}


def relayed() -> list[dict[str, Any]]:
    """The latest state of each piece of work relayed in this process (its description,
    unit, total, count done, values and whether it finished); finished ones are handed out
    once more, then forgotten."""
    if _relay is None:
        return []
    states = list(_relay.values())
    for state in states:
        if state["finished"]:
            _relay.pop(state["desc"], None)
    return states


class Progress:
    """A bar (terminal) or plain lines (anything else) for ``total`` units of work."""

    def __init__(
        self,
        total: int | None,
        desc: str,
        unit: str = "it",
        stream: TextIO | None = None,
        every_s: float | None = None,
        leave: bool = False,
        final_line: bool = True,
        position: int | None = None,
        shown: bool = True,
    ) -> None:
        """``every_s``: seconds between plain lines (default ``PLAIN_EVERY_S``).
        ``final_line``: in plain mode, a line at the end even when none was due.
        ``position``: the bar's line, for bars of several processes on one terminal.
        ``shown=False``: nothing at all (the other ranks of a data-parallel update)."""
        self.stream = stream if stream is not None else sys.stderr
        self.total, self.desc, self.unit = total, desc, unit
        self.every_s = PLAIN_EVERY_S if every_s is None else every_s
        self.done, self.values, self.final_line, self.lines = 0, {}, final_line, 0
        self.started = self.line_at = time.monotonic()
        self.done_at_last_line = 0
        self.relay = _relay if shown else None
        self.quiet = not shown or self.relay is not None
        terminal = not self.quiet and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.bar = (
            tqdm(total=total, desc=desc, unit=unit, file=self.stream, leave=leave, position=position)
            if terminal
            else None
        )
        self._relay_state(finished=False)

    def update(self, n: int = 1, **values: Any) -> None:
        """``n`` more units done; ``values`` (e.g. ``loss=...``) shown beside the count."""
        self.done += n
        self.values.update(values)
        if self.bar is not None:
            if values:
                self.bar.set_postfix(values, refresh=False)
            self.bar.update(n)
        elif self.relay is not None:
            self._relay_state(finished=False)
        elif (
            not self.quiet
            and time.monotonic() - self.line_at >= self.every_s
            and (self.total is None or self.done < self.total)
        ):
            self._line()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.relay is not None:
            self._relay_state(finished=True)
        elif not self.quiet and self.final_line:
            self._line(final=True)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _relay_state(self, finished: bool) -> None:
        if self.relay is not None:
            self.relay[self.desc] = {
                "desc": self.desc,
                "unit": self.unit,
                "total": self.total,
                "done": self.done,
                "values": dict(self.values),
                "finished": finished,
            }

    def _line(self, final: bool = False) -> None:
        """The rate since the last line (the machine may be busier now), since the start
        for the first and the last line."""
        now = time.monotonic()
        if final or not self.lines:
            recent = self.done / max(now - self.started, 1e-9)
        else:
            recent = (self.done - self.done_at_last_line) / max(now - self.line_at, 1e-9)
        self.line_at, self.lines, self.done_at_last_line = now, self.lines + 1, self.done
        count = f"{self.done}" if self.total is None else f"{self.done}/{self.total}"
        share = f" ({100 * self.done // self.total}%)" if self.total else ""
        left = ""
        if self.total is not None and 0 < self.done < self.total and recent > 0:
            left = f", about {_duration((self.total - self.done) / recent)} left"
        values = "".join(f", {name} {value}" for name, value in self.values.items())
        print(
            f"{self.desc}: {self.unit} {count}{share}, {recent:.2g} {self.unit}/s{left}{values}",
            file=self.stream,
            flush=True,
        )


class Mirror:
    """Shows progress relayed from other processes (``relayed()`` there): one ``Progress``
    here per piece of work, moved on to each state received. Lines only while the work is
    slow (no final line): the step that waited for it reports its end."""

    def __init__(self, stream: TextIO | None = None, every_s: float | None = None) -> None:
        self.stream, self.every_s = stream, every_s
        self.shown: dict[str, Progress] = {}

    def show(self, states: list[dict[str, Any]]) -> None:
        for state in states:
            progress = self.shown.get(state["desc"])
            if progress is None:
                progress = self.shown[state["desc"]] = Progress(
                    state["total"],
                    state["desc"],
                    state["unit"],
                    stream=self.stream,
                    every_s=self.every_s,
                    final_line=False,
                )
            if state["done"] > progress.done or state["values"] != progress.values:
                progress.update(state["done"] - progress.done, **state["values"])
            if state["finished"]:
                self.shown.pop(state["desc"]).close()

    def close(self) -> None:
        for progress in self.shown.values():
            progress.close()
        self.shown = {}


def _duration(seconds: float) -> str:
    """``42s``, ``5m24s``, ``1h05m``: how long, to a person."""
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
