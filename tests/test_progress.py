"""Progress a person can watch: a bar on a terminal, plain lines elsewhere (a pipe, CI)."""

from __future__ import annotations

import io

from drmas.infra.progress import Progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_plain_lines_when_the_output_is_not_a_terminal(monkeypatch):
    """At most a line per interval, with the count, the share, the rate and the latest
    values; and one at the end."""
    clock = iter(range(0, 1000, 10))
    monkeypatch.setattr("drmas.infra.progress.time.monotonic", lambda: float(next(clock)))
    stream = io.StringIO()
    with Progress(20, "warm start solver", unit="step", stream=stream, every_s=25) as progress:
        for step in range(20):
            progress.update(loss=f"{2.0 - step / 10:.3f}")
    lines = stream.getvalue().splitlines()
    assert 2 <= len(lines) < 20
    assert lines[0].startswith("warm start solver: step 3/20 (15%), ") and lines[0].endswith("loss 1.800")
    assert lines[-1].startswith("warm start solver: step 20/20 (100%), ") and lines[-1].endswith("loss 0.100")


def test_a_quick_piece_of_work_prints_one_line_or_none():
    stream = io.StringIO()
    with Progress(3, "warm start verifier", unit="step", stream=stream) as progress:
        progress.update(3, loss="0.500")
    assert stream.getvalue() == stream.getvalue().splitlines()[0] + "\n"
    quiet = io.StringIO()
    with Progress(6, "iteration 0", unit="stage", stream=quiet, final_line=False) as progress:
        progress.update(6)
    assert quiet.getvalue() == ""


def test_a_bar_on_a_terminal():
    stream = Terminal()
    with Progress(4, "warm start solver", unit="step", stream=stream) as progress:
        for _ in range(4):
            progress.update(loss="1.000")
    assert "warm start solver" in stream.getvalue() and "\r" in stream.getvalue()
