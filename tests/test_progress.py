"""Progress a person can watch: a bar on a terminal, plain lines elsewhere (a pipe, CI)."""

from __future__ import annotations

import io

import pytest

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


def test_unknown_length_work_counts_and_the_rate(monkeypatch):
    """A rollout's agent calls: how many an episode takes is the orchestra's affair."""
    clock = iter(range(0, 1000, 10))
    monkeypatch.setattr("drmas.infra.progress.time.monotonic", lambda: float(next(clock)))
    stream = io.StringIO()
    with Progress(None, "rollout 3 (128 episodes)", unit="call", stream=stream, every_s=5, final_line=False) as p:
        p.update(128, agent="solver")
    assert stream.getvalue() == "rollout 3 (128 episodes): call 128, 6.4 call/s, agent solver\n"


def test_a_stage_shows_its_steps_and_loss_in_plain_lines(tmp_path, monkeypatch, capsys):
    """The warm start stage, its output not a terminal (pytest captures it): a line per
    step here (every interval elapsed), with the step count and the loss, per worker group."""
    import re

    from helpers import ROOT, TINY_OVERRIDES

    from drmas.config import load_config
    from drmas.infra.store import Store
    from drmas.stages.policies import init_policies
    from drmas.stages.warmstart import warmstart

    monkeypatch.setattr("drmas.infra.progress.PLAIN_EVERY_S", 0.0)
    config = load_config(
        ROOT / "configs" / "math_tiny.yaml", [*TINY_OVERRIDES, "warmstart.steps=3", f"store.root={tmp_path}"]
    )
    store = Store.from_config(config.store)
    warmstart(config, store, "r", init_policies(config, store, "r"))
    err = capsys.readouterr().err
    for wg in ("solver", "verifier"):
        steps = [
            int(found.group(1))
            for line in err.splitlines()
            if (
                found := re.fullmatch(
                    rf"warm start {wg}: step (\d)/3 \(\d+%\), [\d.e+]+ step/s(, about \d+s left)?, loss \d+\.\d{{3}}",
                    line,
                )
            )
        ]
        assert steps == [1, 2, 3], err


def test_progress_relayed_from_a_worker_process_is_shown_by_the_driver(monkeypatch):
    """A pool worker keeps its progress (nothing printed there: nobody watches it); the
    driver shows what it is handed as if the work ran there, and forgets finished work."""
    from drmas.infra.progress import Mirror, relay_progress, relayed

    monkeypatch.setattr("drmas.infra.progress._relay", None)
    worker_output = io.StringIO()
    relay_progress()
    work = Progress(4, "update solver", unit="micro-batch", stream=worker_output, every_s=0)
    work.update(step="1/2")
    handed = [relayed()]
    work.update(3, step="2/2")
    work.close()
    handed += [relayed(), relayed()]
    assert worker_output.getvalue() == "" and handed[-1] == []  # finished work is handed out once
    monkeypatch.setattr("drmas.infra.progress._relay", None)  # the driver's process
    console = io.StringIO()
    mirror = Mirror(console, every_s=0)
    for states in handed:
        mirror.show(states)
    mirror.close()
    [line] = console.getvalue().splitlines()  # the update's end is the iteration's to report
    assert line.startswith("update solver: micro-batch 1/4 (25%), ") and line.endswith(", step 1/2")


@pytest.mark.slow
def test_work_in_a_pool_worker_shows_its_progress_on_the_drivers_console(local_ray, tmp_path, monkeypatch, capsys):
    """A pool worker is a Ray actor, whose output goes to Ray's log files, not to the
    console of the run: the pool asks it how far its work is while it waits, and shows it."""
    from helpers import ROOT, TINY_OVERRIDES

    from drmas.config import load_config
    from drmas.generation.pool import RayPool
    from drmas.infra.store import Store

    def work_with_progress(worker, steps: int) -> str:  # runs in the actor (pickled by value)
        import time

        from drmas.infra.progress import Progress

        with Progress(steps, f"update {worker.name}", unit="micro-batch") as progress:
            for step in range(steps):
                time.sleep(1.0)
                progress.update(step=f"{step + 1}/{steps}")
        return "trained"

    monkeypatch.setattr("drmas.infra.progress.PLAIN_EVERY_S", 0.0)
    monkeypatch.setattr("drmas.generation.pool.PROGRESS_POLL_S", 0.25)
    config = load_config(ROOT / "configs" / "math_tiny.yaml", [*TINY_OVERRIDES, "workers.sharing=by_model"])
    [group] = config.worker_groups()
    with RayPool(config, Store(str(tmp_path / "store")), threads=1) as pool:
        assert pool.train(group.name, work_with_progress, 3) == "trained"
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith(f"update {group.name}: ")]
    assert [line.split(",")[0] for line in lines] == [
        f"update {group.name}: micro-batch {step}/3 ({100 * step // 3}%)" for step in (1, 2)
    ]
    assert lines[-1].endswith(", step 2/3")


def test_kfp_local_shows_a_tasks_progress_on_the_console(tmp_path):
    """kfp.local's output goes to a log file, a line per task to the console: a task's
    progress lines (its output is not a terminal) reach the console too, named by task."""
    from drmas_kfp.pipelines.local import TaskLog

    console = io.StringIO()
    log = TaskLog(tmp_path / "task.log", console)
    log.write(
        "05:18:50.105 - INFO - Executing task \x1b[96m'warmstart'\x1b[0m\n"
        '            "parameterValues": {\n'
        "            warm start solver: step 120/800 (15%), 2.1 step/s, about 5m24s left, loss 1.234\n"
        "            tracking: http://127.0.0.1:5000/#/experiments/1/runs/abc?workflowType=machine_learning\n"
        "05:24:50.105 - INFO - Task 'warmstart' finished with status SUCCESS\n"
    )
    log.close()
    first, last = console.getvalue().splitlines()
    assert first == "  warmstart: warm start solver: step 120/800 (15%), 2.1 step/s, about 5m24s left, loss 1.234"
    assert last.startswith("task warmstart: executed in ")
