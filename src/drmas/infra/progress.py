"""Progress of long work that a person can watch: a tqdm bar on a terminal, and plain lines
when the output is not one (CI, ``make run | tee``, a pod's log), where a bar would be
either invisible (tqdm turns itself off) or a wall of carriage returns.

    with Progress(total=800, desc="warm start solver", unit="step") as progress:
        for step in range(800):
            ...
            progress.update(loss=f"{loss:.3f}")

A plain line says where the work is, how fast it goes and the latest values given
(``warm start solver: step 120/800 (15%), 2.1 step/s, loss 1.234``); one is printed at most
every ``every_s`` seconds, and one at the end, so a quick piece of work prints one line
(or none, with ``final_line=False``, when something else reports its end).
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from tqdm.auto import tqdm

__all__ = ["PLAIN_EVERY_S", "Progress"]

PLAIN_EVERY_S = 30.0
"""Seconds between two plain progress lines of one piece of work."""


class Progress:
    """A bar (terminal) or plain lines (anything else) for ``total`` units of work."""

    def __init__(
        self,
        total: int,
        desc: str,
        unit: str = "it",
        stream: TextIO | None = None,
        every_s: float = PLAIN_EVERY_S,
        leave: bool = False,
        final_line: bool = True,
    ) -> None:
        """``final_line``: in plain mode, a line at the end even when none was due (off for
        work whose end something else reports, e.g. an iteration's summary line)."""
        self.stream = stream if stream is not None else sys.stderr
        self.total, self.desc, self.unit, self.every_s = total, desc, unit, every_s
        self.done, self.values, self.final_line, self.lines = 0, {}, final_line, 0
        self.started = self.shown = time.monotonic()
        terminal = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.bar = tqdm(total=total, desc=desc, unit=unit, file=self.stream, leave=leave) if terminal else None

    def update(self, n: int = 1, **values: Any) -> None:
        """``n`` more units done; ``values`` (e.g. ``loss=...``) shown beside the count."""
        self.done += n
        self.values.update(values)
        if self.bar is not None:
            if values:
                self.bar.set_postfix(values, refresh=False)
            self.bar.update(n)
        elif time.monotonic() - self.shown >= self.every_s and self.done < self.total:
            self._line()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.final_line or self.lines:
            self._line()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _line(self) -> None:
        now = time.monotonic()
        self.shown, self.lines = now, self.lines + 1
        rate = self.done / max(now - self.started, 1e-9)
        percent = f" ({100 * self.done // self.total}%)" if self.total else ""
        values = "".join(f", {name} {value}" for name, value in self.values.items())
        print(
            f"{self.desc}: {self.unit} {self.done}/{self.total}{percent}, {rate:.2g} {self.unit}/s{values}",
            file=self.stream,
            flush=True,
        )
