"""``drmas submit`` against Kubeflow as operators have it (issue 29, sections 3 and 4):
credentials passed as kfp.Client takes them, and ``--follow``, which submits each part of
a long run when the part before it has succeeded, stops on a failure with the command
that continues, and, run again, submits no part twice.

A real KFP API server needs Kubernetes, which these machines do not have. The follow
tests use ``ScriptedKfpClient``, a scripted stand-in of kfp.Client; the credential test
uses the real kfp.Client against a small HTTP server that records what it is sent."""

import inspect
import json
import shlex
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import kfp
import kfp_server_api
import pytest
from kfp.client.client import RunPipelineResult

from drmas.cli import main
from drmas_kfp.pipelines.submit import COOKIES_ENV, TOKEN_ENV, Credentials, connect

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "configs" / "math_qwen3_4b_gpu.yaml")
LONG_RUN = [CONFIG, "experiment.epochs=null", "experiment.iterations=25", "--iterations-per-run", "10"]
IMAGES = ["--image-registry", "registry.example.com/ml", "--image-tag", "0.1.0-1a2b"]
PART_NAMES = [f"r9 iterations {a}..{b} (part {k}/3)" for k, (a, b) in enumerate([(0, 9), (10, 19), (20, 24)], 1)]


@dataclass
class ScriptedServer:
    """What the stand-in clients share, as a KFP API server would: the experiments, the
    runs, and the end each new run will come to (``outcomes``, in order of creation; a run
    is PENDING, then RUNNING, then its outcome, one state per ``get_run``)."""

    outcomes: list[str] = field(default_factory=list)
    experiments: dict[str, str] = field(default_factory=dict)
    runs: dict[str, dict] = field(default_factory=dict)
    events: list[str] = field(default_factory=list)
    clients: list[dict] = field(default_factory=list)

    def add_run(self, name: str, experiment: str, states: list[str], arguments: dict | None = None) -> str:
        run_id = f"kfp-run-{len(self.runs) + 1}"
        experiment_id = self.experiments.setdefault(experiment, f"exp-{len(self.experiments) + 1}")
        self.runs[run_id] = {
            "name": name,
            "experiment_id": experiment_id,
            "states": list(states),
            "arguments": arguments or {},
            "created": len(self.runs),
        }
        return run_id


class ScriptedKfpClient:
    """A scripted stand-in of kfp.Client (kfp 2.17.3): the methods ``drmas submit`` calls,
    each with kfp.Client's own signature (parameter names, order, kinds and defaults;
    ``test_the_stand_in_keeps_kfp_clients_signatures`` compares them), answering from a
    ``ScriptedServer`` with kfp_server_api's own response types. It records what it is
    given: the constructor's arguments and, in order, every run it creates and every state
    it reports."""

    server = ScriptedServer()

    def __init__(
        self,
        host=None,
        client_id=None,
        namespace="kubeflow",
        other_client_id=None,
        other_client_secret=None,
        existing_token=None,
        cookies=None,
        proxy=None,
        ssl_ca_cert=None,
        kube_context=None,
        credentials=None,
        ui_host=None,
        verify_ssl=None,
    ) -> None:
        self.server.clients.append(
            {
                "host": host,
                "namespace": namespace,
                "existing_token": existing_token,
                "cookies": cookies,
                "credentials": credentials,
            }
        )

    def create_run_from_pipeline_package(
        self,
        pipeline_file,
        arguments=None,
        run_name=None,
        experiment_name=None,
        namespace=None,
        pipeline_root=None,
        enable_caching=None,
        cache_key=None,
        service_account=None,
        experiment_id=None,
    ):
        assert Path(pipeline_file).is_file()
        outcome = self.server.outcomes.pop(0)
        run_id = self.server.add_run(run_name, experiment_name, ["PENDING", "RUNNING", outcome], arguments)
        self.server.events.append(f"create {run_name}")
        return RunPipelineResult(self, kfp_server_api.V2beta1Run(run_id=run_id, display_name=run_name))

    def get_run(self, run_id):
        run = self.server.runs[run_id]
        state = run["states"].pop(0) if len(run["states"]) > 1 else run["states"][0]
        self.server.events.append(f"{run['name']}: {state}")
        return kfp_server_api.V2beta1Run(run_id=run_id, display_name=run["name"], state=state)

    def get_experiment(self, experiment_id=None, experiment_name=None, namespace=None):
        if experiment_name not in self.server.experiments:
            raise ValueError(f"No experiment is found with name {experiment_name}.")
        return kfp_server_api.V2beta1Experiment(
            experiment_id=self.server.experiments[experiment_name], display_name=experiment_name
        )

    def list_runs(self, page_token="", page_size=10, sort_by="", experiment_id=None, namespace=None, filter=None):
        [predicate] = json.loads(filter)["predicates"]
        assert predicate["key"] == "display_name" and sort_by == "created_at desc"
        found = [
            (run_id, run)
            for run_id, run in self.server.runs.items()
            if run["experiment_id"] == experiment_id and run["name"] == predicate["stringValue"]
        ]
        found.sort(key=lambda item: -item[1]["created"])
        return kfp_server_api.V2beta1ListRunsResponse(
            runs=[
                kfp_server_api.V2beta1Run(run_id=run_id, display_name=run["name"], state=run["states"][0])
                for run_id, run in found
            ],
            total_size=len(found),
        )


@pytest.fixture
def server(monkeypatch, tmp_path) -> Iterator[ScriptedServer]:
    """A fresh scripted server behind every kfp.Client the test's commands create; no
    waiting between polls; the default images."""
    scripted = ScriptedServer()
    monkeypatch.setattr(ScriptedKfpClient, "server", scripted)
    monkeypatch.setattr(kfp, "Client", ScriptedKfpClient)
    monkeypatch.setattr("drmas_kfp.pipelines.submit.time.sleep", lambda seconds: None)
    monkeypatch.setenv("DRMAS_LAST_BUILD", str(tmp_path / "no-build"))
    for name in (TOKEN_ENV, COOKIES_ENV, "KF_PIPELINES_SA_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    yield scripted


def follow(*extra: str) -> list[str]:
    return ["submit", *LONG_RUN, "--host", "http://kfp.example", "--run-id", "r9", *IMAGES, "--follow", *extra]


def created(server: ScriptedServer) -> list[str]:
    return [event.removeprefix("create ") for event in server.events if event.startswith("create ")]


def test_the_stand_in_keeps_kfp_clients_signatures():
    """Each method the stand-in offers takes what kfp.Client's does, in the same order and
    with the same defaults: drmas cannot call it in a way the real client would refuse."""
    real = kfp.client.client.Client
    for name in ("__init__", "create_run_from_pipeline_package", "get_run", "get_experiment", "list_runs"):
        ours, theirs = inspect.signature(getattr(ScriptedKfpClient, name)), inspect.signature(getattr(real, name))
        assert [(p.name, p.kind, p.default) for p in ours.parameters.values()] == [
            (p.name, p.kind, p.default) for p in theirs.parameters.values()
        ], name


def test_follow_submits_each_part_once_the_part_before_it_has_succeeded(server, capsys):
    """Three parts: each created only after the state of the one before was SUCCEEDED, each
    starting from the checkpoint the part before it ends with."""
    server.outcomes = ["SUCCEEDED"] * 3
    assert main(follow()) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "every part of drmas run r9 succeeded" in out
    assert created(server) == PART_NAMES
    for before, after in zip(PART_NAMES, PART_NAMES[1:], strict=False):
        assert server.events.index(f"{before}: SUCCEEDED") < server.events.index(f"create {after}")
    checkpoints = [run["arguments"].get("start_checkpoint") for run in server.runs.values()]
    assert checkpoints == [
        None,
        "s3://drmas/runs/math-qwen3-4b/r9/iter-000009/checkpoint",
        "s3://drmas/runs/math-qwen3-4b/r9/iter-000019/checkpoint",
    ]


def test_follow_stops_on_a_failure_with_the_command_that_continues_which_skips_what_succeeded(server, capsys):
    """Part 2 fails: nothing more is submitted, and the command printed to continue, run,
    submits neither part 1 again (it succeeded) nor anything before part 2."""
    server.outcomes = ["SUCCEEDED", "FAILED"]
    assert main(follow("--poll-seconds", "5")) == 1
    err = capsys.readouterr().err
    assert f"{PART_NAMES[1]}: KFP run kfp-run-2 failed" in err
    assert created(server) == PART_NAMES[:2]
    [command] = [line.strip() for line in err.splitlines() if line.strip().startswith("drmas submit ")]
    words = shlex.split(command)
    assert words[words.index("--run-id") + 1] == "r9" and "--follow" in words
    assert words[words.index("--poll-seconds") + 1] == "5" and words[words.index("--image-tag") + 1] == "0.1.0-1a2b"

    server.events.clear()
    server.outcomes = ["SUCCEEDED", "SUCCEEDED"]
    assert main(words[1:]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert f"{PART_NAMES[0]}: KFP run kfp-run-1 succeeded before: not submitted again" in out
    assert created(server) == PART_NAMES[1:]
    assert len(server.runs) == 4  # part 1 once, part 2 twice (failed, then again), part 3 once


def test_a_restart_follows_a_part_still_running_instead_of_submitting_it_again(server, capsys):
    """The command that followed was stopped (a laptop closed) while part 1 ran: run again,
    it follows that KFP run to its end and submits only the parts after it."""
    running = server.add_run(PART_NAMES[0], "math-qwen3-4b", ["RUNNING", "RUNNING", "SUCCEEDED"])
    server.outcomes = ["SUCCEEDED", "SUCCEEDED"]
    assert main(follow()) == 0, capsys.readouterr().err
    assert f"{PART_NAMES[0]}: following KFP run {running}, submitted before (running)" in capsys.readouterr().out
    assert created(server) == PART_NAMES[1:]


def test_an_api_server_that_stops_answering_ends_with_the_command_that_continues(server, capsys, monkeypatch):
    def unreachable(self, run_id):
        raise kfp_server_api.ApiException(status=503, reason="Service Unavailable")

    server.outcomes = ["SUCCEEDED"]
    monkeypatch.setattr(ScriptedKfpClient, "get_run", unreachable)
    assert main(follow()) == 1
    err = capsys.readouterr().err
    assert "the KFP API server http://kfp.example failed: ApiException" in err and "--follow" in err


def test_credentials_reach_kfp_client_as_it_takes_them_and_stay_out_of_printed_commands(
    server, capsys, monkeypatch, tmp_path
):
    """--token-file becomes kfp's ServiceAccountTokenVolumeCredentials (re-read before
    each request); $DRMAS_KFP_TOKEN existing_token; $DRMAS_KFP_COOKIES cookies; with no
    --token-file, kfp's own $KF_PIPELINES_SA_TOKEN_PATH. The next parts' commands name the
    token file, never a token or cookie."""
    from kfp.client.set_volume_credentials import ServiceAccountTokenVolumeCredentials

    token = tmp_path / "token"
    token.write_text("file-token")
    monkeypatch.setenv(TOKEN_ENV, "env-token")
    monkeypatch.setenv(COOKIES_ENV, "authservice_session=abc")
    server.outcomes = ["SUCCEEDED"]
    argv = ["submit", *LONG_RUN, "--host", "https://kf.example/pipeline", "--run-id", "r9", *IMAGES]
    assert main([*argv, "--namespace", "team-a", "--token-file", str(token)]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    [client] = server.clients
    assert client["namespace"] == "team-a" and client["host"] == "https://kf.example/pipeline"
    assert client["existing_token"] == "env-token" and client["cookies"] == "authservice_session=abc"
    assert isinstance(client["credentials"], ServiceAccountTokenVolumeCredentials)
    assert client["credentials"]._get_token() == "file-token"
    commands = [line for line in out.splitlines() if line.strip().startswith("drmas submit")]
    assert len(commands) == 2 and all(f"--token-file {token}" in command for command in commands)
    assert "env-token" not in out and "abc" not in out

    monkeypatch.setenv("KF_PIPELINES_SA_TOKEN_PATH", str(token))
    assert Credentials.from_environment().token_file == str(token)
    assert main([*argv, "--token-file", str(tmp_path / "nothing")]) == 1
    assert f"--token-file {tmp_path / 'nothing'}: no such file" in capsys.readouterr().err


class RecordingApi:
    """An HTTP server answering kfp.Client's health check (/apis/v2beta1/healthz) and
    recording the Authorization and Cookie headers of every request."""

    def __init__(self) -> None:
        self.headers: list[tuple[str | None, str | None]] = []
        recorded = self.headers

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                recorded.append((self.headers.get("Authorization"), self.headers.get("Cookie")))
                body = json.dumps({"commit_sha": "x", "tag_name": "2.17.0", "multi_user": True}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.host = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_the_real_kfp_client_sends_the_token_file_and_cookies_and_rereads_a_rotated_token(tmp_path, monkeypatch):
    """``connect`` with kfp 2.17.3's own Client: a token file goes out as a bearer token and
    is read again for a later request (a projected token rotates); cookies go out as the
    Cookie header; $DRMAS_KFP_TOKEN goes out as the bearer token when no file is given."""
    monkeypatch.setattr(kfp.Client, "_LOCAL_KFP_CONTEXT", str(tmp_path / "kfp-context.json"))
    api = RecordingApi()
    try:
        token = tmp_path / "token"
        token.write_text("first")
        client = connect(api.host, "team-a", Credentials(token_file=str(token), cookies="authservice_session=abc"))
        client.get_kfp_healthz()
        token.write_text("rotated")
        client.get_kfp_healthz()
        assert api.headers[-2:] == [
            ("Bearer first", "authservice_session=abc"),
            ("Bearer rotated", "authservice_session=abc"),
        ]
        connect(api.host, "team-a", Credentials(token="plain")).get_kfp_healthz()
        assert api.headers[-1] == ("Bearer plain", None)
    finally:
        api.close()


def test_submit_warns_when_the_steps_would_log_to_mlflow_files_in_their_own_pods(server, capsys):
    """The MLflow address is the config's tracking.uri, read by every step: a file URI (or
    none, which means a file) on a cluster is lost with each pod."""
    server.outcomes = ["SUCCEEDED", "SUCCEEDED"]
    argv = ["submit", CONFIG, "experiment.epochs=null", "experiment.iterations=2", "--host", "http://kfp.example"]
    assert main([*argv, "--run-id", "a"]) == 0
    assert "tracking.uri" not in capsys.readouterr().err  # the recipe names the MLflow server
    assert main([*argv, "--run-id", "b", "tracking.uri=null"]) == 0
    assert "warning: tracking.uri is unset: each pipeline step would log to an MLflow file" in capsys.readouterr().err
