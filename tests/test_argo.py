"""A compiled pipeline run as Argo runs it on a cluster (every task whose dependencies are
done starts at once, each in its own process: ``drmas run --via kfp-local --parallel``)
gives the results of a sequential kfp.local run, byte for byte, and no two tasks that use
the run's pool ever run at the same time: the pipeline's edges order them
(``drmas.stages.iteration.pool_edges``)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from helpers import LOG_MARK, TINY_OVERRIDES, via_kfp_local

SETTINGS = [
    *TINY_OVERRIDES,
    "experiment.iterations=2",
    "eval.every=1",
    "eval.max_questions=2",
    "eval.k=2",
    "warmstart.steps=0",
]
"""The tiny math team, 2 iterations (the pool passes from one iteration's tasks to the
next's), an evaluation before training and after each."""

POOL_TASKS = re.compile(r"(rollout|update|evaluate)(-\d+)?")
LINE = re.compile(r"^(?:\d{4}-\d\d-\d\d )?(\d\d):(\d\d):(\d\d)[.,](\d{3}) - \w+ - (.*)$")
"""A record of kfp.local's log: its own logger's (``05:18:50.104 - INFO - ...``) or the
root logger's (``2026-12-05 05:18:56,894 - INFO - ...``)."""
ANSI = re.compile(r"\x1b\[[0-9;]*m")
STARTED = re.compile(r"Executing task '([\w.-]+)'")
FINISHED = re.compile(r"Task '([\w.-]+)' finished with status (\w+)")


def task_intervals(log: str) -> dict[str, tuple[float, float]]:
    """Task -> (started, finished), seconds of the day, from kfp.local's timestamped log."""
    started: dict[str, float] = {}
    intervals = {}
    for line in ANSI.sub("", log).splitlines():
        if not (record := LINE.match(line)):
            continue
        hours, minutes, seconds, millis, message = record.groups()
        when = int(hours) * 3600 + int(minutes) * 60 + int(seconds) + int(millis) / 1000
        if found := STARTED.search(message):
            started[found.group(1)] = when
        elif found := FINISHED.search(message):
            assert found.group(2) == "SUCCESS", line
            intervals[found.group(1)] = (started.pop(found.group(1)), when)
    return intervals


def stored_results(runs: Path) -> dict[str, dict[str, object]]:
    """Artifact -> {file: sha256} of every stage output of the run, from the manifests;
    the timings (metrics.json), the run's record (it names the store) and the report aside."""
    results = {}
    for manifest in sorted(runs.rglob("_MANIFEST.json")):
        artifact = manifest.parent.relative_to(runs).as_posix()
        if artifact.endswith(("/run", "/report")):
            continue
        files = json.loads(manifest.read_text())["files"]
        results[artifact] = {name: entry["sha256"] for name, entry in files.items() if name != "metrics.json"}
        if "checkpoint.json" in files:  # it names its artifacts by manifest hashes, which cover their timings
            named = json.loads((manifest.parent / "checkpoint.json").read_text())["worker_groups"]
            results[artifact]["checkpoint.json"] = {
                wg: {key: value for key, value in entry.items() if not key.endswith("_manifest")}
                for wg, entry in named.items()
            }
    return results


@pytest.mark.slow
@pytest.mark.e2e
def test_a_run_as_argo_runs_it_equals_a_sequential_one_and_never_shares_the_pool(tmp_path):
    (tmp_path / "sequential").mkdir()
    (tmp_path / "parallel").mkdir()
    sequential = via_kfp_local(tmp_path / "sequential", SETTINGS, "--run-id", "k")
    parallel = via_kfp_local(tmp_path / "parallel", SETTINGS, "--run-id", "k", "--parallel")
    expected = stored_results(tmp_path / "sequential" / "runs")
    assert sum(name.endswith("/checkpoint") for name in expected) == 2
    assert sum("evaluate" in name for name in expected) == 3  # before training, after each iteration
    assert stored_results(tmp_path / "parallel" / "runs") == expected

    intervals = task_intervals(parallel.split(LOG_MARK, 1)[1])
    pool_users = sorted((span, name) for name, span in intervals.items() if POOL_TASKS.fullmatch(name))
    assert len(pool_users) == 2 + 2 * 2 + 3  # rollouts, two updates each, evaluations
    for (before, first), (after, second) in zip(pool_users[:-1], pool_users[1:], strict=True):
        assert after[0] >= before[1], f"{second} started before {first} had finished: both on the pool"
    # The parallel run did run independent tasks at once (the MLflow steps beside the stages).
    spans = sorted(intervals.values())
    assert any(later[0] < earlier[1] for earlier, later in zip(spans[:-1], spans[1:], strict=True)), (
        "nothing ran in parallel"
    )
    assert sequential.count("Executing task") == parallel.count("Executing task")
