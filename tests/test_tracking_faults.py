"""The MLflow server goes away mid-run: training goes on, tracking costs bounded time, what
was logged during the outage reaches MLflow when the server is back, and what never could
is counted and reported.

A real MLflow tracking server (``mlflow server``, sqlite backend, artifacts served through
it) on 127.0.0.1, started by the fixture and killed by its PID (its own process group). Two
faults a real server cannot be made to show on cue are played, in the killed server's
place on its port, by a plain socket server (a fake at the network boundary): one that
accepts connections and never answers (a hung server), and one that answers every request
``503`` with ``Retry-After: 3600`` (a proxy in front of a dead backend).

The tests share the session's server (``conftest.mlflow_server``, started again after a
test kills it; each start takes 10-30 s on 2 cores); one test needs no server (local
sqlite). The module takes two to three minutes on a busy 2-core machine, most of it server
starts and one tiny ``drmas run`` (marked slow).
"""

from __future__ import annotations

import os
import re
import signal
import socketserver
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import TINY_OVERRIDES

from drmas.config import DrmasConfig, load_config
from drmas.infra.tracking import HTTP_LIMITS, Tracker

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
MLFLOW = Path(sys.executable).parent / "mlflow"


class StandIn(socketserver.ThreadingTCPServer):
    """On a dead server's port: counts connections and either holds each one silently
    (``busy=False``: a hung server) or answers each request 503 with ``Retry-After: 3600``."""

    allow_reuse_address = True
    daemon_threads = True

    def __init__(self, port: int, busy: bool) -> None:
        self.busy = busy
        self.connections = 0
        self.closing = threading.Event()
        super().__init__(("127.0.0.1", port), _StandInHandler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def __enter__(self) -> StandIn:
        return self

    def __exit__(self, *exc: object) -> None:
        self.closing.set()
        self.shutdown()
        self.server_close()


class _StandInHandler(socketserver.StreamRequestHandler):
    server: StandIn

    def handle(self) -> None:
        self.server.connections += 1
        if not self.server.busy:
            self.server.closing.wait()
            return
        length = 0
        while (line := self.rfile.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            length = int(value) if name.strip().lower() == "content-length" else length
        self.rfile.read(length)
        self.wfile.write(
            b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 3600\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        )


def _config(tracking: str) -> DrmasConfig:
    return load_config(ROOT / "configs" / "math_tiny.yaml", [f"tracking.uri={tracking}"])


def _metrics(step: int) -> dict[str, float]:
    return {"reward/mean": step / 10, "loss": 1 / step}


def _timed(call: Callable[..., None], *args: object) -> float:
    began = time.monotonic()
    call(*args)
    return time.monotonic() - began


def _session_commands(leader: int) -> list[str]:
    """The command lines of the processes in the session that ``leader`` leads."""
    commands = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
            if entry.name.isdigit() and int(stat.rsplit(")", 1)[1].split()[3]) == leader:
                commands.append((entry / "cmdline").read_bytes().replace(b"\0", b" ").decode())
        except (OSError, ValueError):
            continue  # gone meanwhile, or not a process
    return commands


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_the_server_runs_without_mlflows_job_runner(mlflow_server):
    """MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false, as ``make ui`` and the cluster's manifest set
    it, is the switch this MLflow reads: the server and its web worker, no huey consumers."""
    commands = _session_commands(mlflow_server.process.pid)
    assert commands and not [command for command in commands if "huey" in command or "_job_runner" in command]
    assert len(commands) <= 3, commands


def test_a_temporary_outage_leaves_no_hole(tmp_path, mlflow_server):
    """Killed after step 3, back after step 6: steps 4-6 (metrics and lineage) are kept,
    cost milliseconds, and reach MLflow with their original steps and times."""
    import mlflow

    tracker = Tracker(_config(mlflow_server.uri), "outage", str(tmp_path / "runs"), cooldown_s=1.0)
    for step in (1, 2, 3):
        tracker.log_metrics(_metrics(step), step)
    mlflow_server.kill()
    began = time.monotonic()
    for step in (4, 5, 6):
        tracker.log_metrics(_metrics(step), step)
        tracker.log_lineage(step - 1, {"checkpoint": f"/store/iter-{step - 1:06d}/checkpoint"})
    assert time.monotonic() - began < 5, "MLflow's own retries (7, with back-off) would hold each call for minutes"
    assert tracker.undelivered() == {"lineage": 3, "metrics": 3} and tracker.outages == 1
    restarted_ms = int(time.time() * 1000)
    mlflow_server.start()
    for step in (7, 8):
        tracker.log_metrics(_metrics(step), step)
    assert tracker.undelivered() == {}
    tracker.finish()

    assert (tracker.gaps, tracker.delivered_late) == (0, 6)
    report = tracker.gap_report()
    assert (
        "unreachable 1 time(s)" in report
        and "6 held-back call(s) were delivered late" in report
        and "nothing is missing" in report
    )
    client = mlflow.MlflowClient(mlflow_server.uri)
    history = sorted(client.get_metric_history(tracker.mlflow_run_id, "reward/mean"), key=lambda metric: metric.step)
    assert [(metric.step, metric.value) for metric in history] == [(step, step / 10) for step in range(1, 9)]
    logged_at = [metric.timestamp for metric in history]
    assert max(logged_at[:6]) <= restarted_ms < min(logged_at[6:]), (
        "steps 4-6 keep the time they were logged at, not their delivery's"
    )
    run = client.get_run(tracker.mlflow_run_id)
    assert run.info.status == "FINISHED" and run.data.params["algorithm.advantage"] == "drmas"
    assert run.data.tags["lineage.checkpoint"] == "/store/iter-000005/checkpoint"
    assert [a.path for a in client.list_artifacts(tracker.mlflow_run_id, "lineage")] == [
        f"lineage/iter-{i:06d}.json" for i in (3, 4, 5)
    ]
    assert not set(HTTP_LIMITS) & set(os.environ), "drmas's limits apply to its own calls only"


@pytest.mark.timeout(120)
def test_a_server_that_never_comes_back_costs_bounded_time(tmp_path, mlflow_server, monkeypatch, caplog):
    """Killed after step 1; its port then hangs, then answers 503 with Retry-After: 3600.
    One call pays the timeout (the user's 1 s, twice), the cool-down spares the next ones,
    Retry-After is not obeyed, ``finish`` tries once, and the report names what is missing."""
    import mlflow

    tracker = Tracker(_config(mlflow_server.uri), "gone", str(tmp_path / "runs"), cooldown_s=2.0, max_pending=6)
    tracker.log_metrics(_metrics(1), 1)
    mlflow_server.kill()
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "1")  # the user's own setting: drmas keeps it
    with StandIn(mlflow_server.port, busy=False) as hung:
        costs = []
        for step in (2, 3, 4):
            costs.append(_timed(tracker.log_metrics, _metrics(step), step))
            costs.append(_timed(tracker.log_episodes, step - 1, {"agent": ["solver"], "response_text": ["\\boxed{4}"]}))
        assert 1.5 < costs[0] < 4, costs
        assert sum(costs[1:]) < 0.5, f"the cool-down keeps later calls off the network: {costs}"
        assert hung.connections == 2
    time.sleep(2.0)
    with StandIn(mlflow_server.port, busy=True) as busy:
        assert _timed(tracker.log_metrics, _metrics(5), 5) < 2, "Retry-After: 3600 must not be obeyed"
        assert busy.connections == 2
        assert _timed(tracker.finish) < 2
        assert busy.connections == 4, "finish tries once more, whatever the cool-down"

    assert tracker.undelivered() == {"episodes": 3, "metrics": 4, "status": 1} and tracker.gaps == 8
    report = tracker.gap_report()
    assert (
        "still unreachable at the last try" in report and "metrics 4 (steps 2-5)" in report and "as running" in report
    )
    assert "delivered late" not in report
    lost = [record.getMessage() for record in caplog.records if "6 calls are already waiting" in record.getMessage()]
    assert lost == [
        "tracking: metrics (step 5) not logged to MLflow: 6 calls are already waiting for the server",
        "tracking: status not logged to MLflow: 6 calls are already waiting for the server",
    ]
    assert any("is unreachable" in record.getMessage() for record in caplog.records)
    stored = mlflow.MlflowClient(mlflow_server.database)
    assert [metric.step for metric in stored.get_metric_history(tracker.mlflow_run_id, "reward/mean")] == [1]
    assert stored.get_run(tracker.mlflow_run_id).info.status == "RUNNING"


def test_a_refused_call_is_counted_and_holds_nothing_back(tmp_path):
    """Not an outage: MLflow (local sqlite here) refuses a call for what it sends (a 4xx),
    and a value is not a number. Both calls are counted lost, the breaker stays closed, and
    the calls after them go through."""
    import mlflow

    tracker = Tracker(_config(f"sqlite:///{tmp_path / 'mlflow.db'}"), "refused", str(tmp_path / "runs"))
    tracker.log_metrics({"reward/../mean": 1.0}, 1)
    tracker.log_metrics({"reward/mean": "n/a"}, 2)  # type: ignore[dict-item]
    tracker.log_metrics(_metrics(3), 3)
    tracker.finish()
    assert tracker.undelivered() == {"metrics": 2} and tracker.outages == 0
    assert tracker.gap_report() == "calls not in MLflow: metrics 2 (steps 1); the store holds every result"
    client = mlflow.MlflowClient(tracker.uri)
    assert [metric.step for metric in client.get_metric_history(tracker.mlflow_run_id, "reward/mean")] == [3]
    assert client.get_run(tracker.mlflow_run_id).info.status == "FINISHED"


@pytest.mark.e2e
def test_drmas_run_survives_the_server_going_away(tmp_path, mlflow_server):
    """``drmas run`` against a server killed once the first iteration is checkpointed:
    exit 0, every checkpoint in the store, the outage and what MLflow lacks on its output."""
    command = [
        str(Path(sys.executable).parent / "drmas"),
        "run",
        str(ROOT / "configs" / "math_tiny.yaml"),
        *TINY_OVERRIDES,
        "experiment.iterations=2",
        "eval.every=0",
        "warmstart.steps=0",
        f"store.root={tmp_path / 'runs'}",
        f"tracking.uri={mlflow_server.uri}",
        "--run-id",
        "cut",
    ]
    run = subprocess.Popen(
        command,
        cwd=tmp_path,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        first = _checkpoint(tmp_path, 0)
        deadline = time.monotonic() + 300
        while not first.exists() and run.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        mlflow_server.kill()
        output, _ = run.communicate(timeout=300)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    assert run.returncode == 0, output
    assert all(_checkpoint(tmp_path, i).exists() for i in range(2))
    assert f"MLflow at {mlflow_server.uri} is unreachable" in output
    assert re.search(
        r"calls not in MLflow: .*metrics [12] \(steps (1-)?2\).*\(MLflow still shows the run as running\)", output
    ), output


def _checkpoint(tmp_path: Path, iteration: int) -> Path:
    return tmp_path / "runs" / "math-tiny" / "cut" / f"iter-{iteration:06d}" / "checkpoint" / "_MANIFEST.json"


def test_experiments_open_on_training_runs_in_the_mlflow_ui(tmp_path):
    """MLflow 3's UI opens an experiment by its ``mlflow.experimentKind`` tag: drmas tags
    the experiments it creates or finds untagged as model development, and keeps a kind
    that a user set."""
    import mlflow

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    Tracker(_config(uri), "first", str(tmp_path / "runs")).finish()
    client = mlflow.MlflowClient(uri)
    experiment = client.get_experiment_by_name("math-tiny")
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    client.set_experiment_tag(experiment.experiment_id, "mlflow.experimentKind", "genai_development")
    Tracker(_config(uri), "second", str(tmp_path / "runs")).finish()
    assert client.get_experiment(experiment.experiment_id).tags["mlflow.experimentKind"] == "genai_development"


def test_a_pipelines_tracking_steps_never_fail_it(tmp_path, caplog):
    """The Kubeflow tracking steps with MLflow unreachable (a refused port): each returns
    (the step succeeds), says in a warning what was not logged and why, and the start and
    end steps still publish their page, naming the store and the problem."""
    from localmlflow import _free_port

    from drmas.infra.store import Store
    from drmas.stages.track import track_end, track_iteration, track_start

    config = _config(f"http://127.0.0.1:{_free_port()}")
    store = Store(str(tmp_path / "runs"))
    with caplog.at_level("WARNING", logger="drmas"):
        started = time.monotonic()
        start = track_start(config, store, "r", 0, {"kfp.run_id": "k"})
        track_iteration(config, store, "r", 0)
        end = track_end(config, store, "r", config.experiment.iterations - 1)
        took = time.monotonic() - started
    assert took < 30
    for page in (start, end):
        assert "cannot open the MLflow run" in page and str(tmp_path / "runs" / "math-tiny" / "r") in page
    warnings = [record.getMessage() for record in caplog.records]
    assert any("the start of the run not logged to MLflow" in w for w in warnings)
    assert any("iteration 0 not logged to MLflow" in w for w in warnings)
    assert any("the end of the run not logged to MLflow" in w for w in warnings)
    assert all("the pipeline goes on" in w for w in warnings if "not logged" in w)


def test_every_mlflow_link_opens_the_model_training_mode(tmp_path, mlflow_server):
    """MLflow 3's UI shows an experiment's GenAI pages unless the link's route asks for
    ``workflowType=machine_learning`` (the UI reads it from the query of the route after
    the ``#``). The links of a run on a server, behind another address, and in a sqlite
    file (where ``mlflow ui`` serves it, with that command), and the Kubeflow steps' page."""
    from drmas.infra.store import Store
    from drmas.infra.tracking import ui_link
    from drmas.stages.track import track_start

    assert ui_link("http://127.0.0.1:5000/", "experiments/3/runs/abc") == (
        "http://127.0.0.1:5000/#/experiments/3/runs/abc?workflowType=machine_learning"
    )
    served = Tracker(_config(mlflow_server.uri), "linked", str(tmp_path / "runs"))
    page = f"experiments/{served.experiment_id}/runs/{served.mlflow_run_id}"
    assert served.where() == f"{mlflow_server.uri}/#/{page}?workflowType=machine_learning"
    assert served.where("https://mlflow.example.org/") == (
        f"https://mlflow.example.org/#/{page}?workflowType=machine_learning"
    )
    markdown = track_start(_config(mlflow_server.uri), Store(str(tmp_path / "runs")), "linked", 1, {})
    assert f"]({mlflow_server.uri}/#/{page}?workflowType=machine_learning)" in markdown
    served.finish()
    database = f"sqlite:///{tmp_path / 'mlflow.db'}"
    local = Tracker(_config(database), "local", str(tmp_path / "runs"))
    page = f"experiments/{local.experiment_id}/runs/{local.mlflow_run_id}"
    assert local.where() == (
        f"http://127.0.0.1:5000/#/{page}?workflowType=machine_learning "
        f"(start the UI first: mlflow ui --backend-store-uri {database})"
    )
    local.finish()
