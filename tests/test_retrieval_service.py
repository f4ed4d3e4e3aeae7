"""Retrieval served over HTTP (``drmas.tasks.search.service``): the same passages as
the in-process BM25, a search rollout through it equal to one in process, retries of a
transient failure, a clear failure of a dead, silent or wrong service, 400s for bad
requests, and cache keys that follow the corpus but not where it is served from.

Every service here is real and listens on 127.0.0.1 on a free port: one started as the
command (``python -m drmas.tasks.search.service``, in a subprocess), the others in a
thread of the test; each test stops what it started.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from helpers import free_port, running, write_corpus

from drmas.config import ConfigError, DrmasConfig, load_config
from drmas.generation.workers import GenerationResult
from drmas.infra.layout import stage_path
from drmas.infra.store import Store
from drmas.stages.contracts import EvaluateContract, RolloutContract, cache_key
from drmas.stages.rollout import rollout
from drmas.tasks import DataError
from drmas.tasks.search.client import RetrievalClient, RetrievalError, RetrievalMismatch, RetrievalUnavailable
from drmas.tasks.search.corpus import corpus_for
from drmas.tasks.search.retrieval import Retriever, Tokenization
from drmas.tasks.search.service import RetrievalServer, load_passages, main, serve
from drmas.tasks.search.task import SearchTask, retrieval_client
from drmas.tasks.search.world import generate_fact_world
from drmas.team.orchestras import Passage

ROOT = Path(__file__).resolve().parents[1]
SEED = 3
QUERIES = [
    "capital",
    "founded by",
    "born in 1700",
    "",  # no term: []
    "the of a",  # only stopwords: []
    "xyzzy plugh",  # unknown words: []
    "town founded born capital country",
]


@pytest.fixture(scope="module")
def passages() -> list[Passage]:
    return generate_fact_world(SEED, entities=30)[0]


@pytest.fixture(scope="module")
def corpus_file(passages: list[Passage], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus") / "corpus.jsonl", passages)


@pytest.fixture
def service(passages: list[Passage], tmp_path: Path) -> Iterator[RetrievalServer]:
    with running(serve(passages, Store(str(tmp_path / "service-store")), "127.0.0.1", 0)) as server:
        assert isinstance(server, RetrievalServer)
        yield server


# --------------------------------------------------------------------------------------
# The command and what it serves
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def command_service(corpus_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Any]]:
    """``python -m drmas.tasks.search.service`` on a free port: (its URL, the process)."""
    store = tmp_path_factory.mktemp("command-store")
    process = subprocess.Popen(
        [sys.executable, "-m", "drmas.tasks.search.service", "--corpus", str(corpus_file)]
        + ["--store", str(store), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert process.stdout is not None
        ready = process.stdout.readline()  # blocks until the ready line (or the exit)
        match = re.search(r"(http://127\.0\.0\.1:\d+) serves (\d+) passages", ready)
        assert match, f"no ready line: {ready!r}; stderr: {process.stderr.read() if process.poll() else ''}"
        yield match.group(1), process
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(10)


def test_served_search_equals_in_process_search(command_service, passages):
    """The command's service returns exactly what ``Retriever.search`` returns for the same
    corpus: same passages, same order, the empty cases, k clamped to the corpus; whether
    the queries go in one request or in batches."""
    url, _ = command_service
    local = Retriever.build(passages)
    health = json.loads(urllib.request.urlopen(f"{url}/health", timeout=10).read())
    assert health == {
        "status": "ok",
        "corpus_hash": Retriever.corpus_hash(passages),
        "passages": len(passages),
        "format": "drmas.bm25/1",
        "method": "bm25",
        "settings": {"stemmer": "none", "stopwords": "english"},
    }
    for k in (1, 3, 1000):  # 1000: more than the corpus holds
        expected = local.search(QUERIES, k)
        assert RetrievalClient(url, expected_hash=Retriever.corpus_hash(passages)).search(QUERIES, k) == expected
        assert RetrievalClient(url, batch_size=2).search(QUERIES, k) == expected
    assert any(len(found) == 3 for found in local.search(QUERIES, 3))  # the comparison is not of empties
    assert RetrievalClient(url).search([], 3) == []


def test_the_command_stops_cleanly_on_sigterm(command_service):
    """What Kubernetes sends a pod it stops: the service exits 0. (Last: it ends the
    module's service.)"""
    _, process = command_service
    process.send_signal(signal.SIGTERM)
    assert process.wait(10) == 0


def test_the_command_binds_loopback_by_default_and_names_a_bad_corpus(tmp_path, capsys):
    server = serve([Passage("0", "one fact")], Store(str(tmp_path / "store")), port=0)
    try:
        assert server.server_address[0] == "127.0.0.1"
    finally:
        server.server_close()
    assert main(["--corpus", str(tmp_path / "missing.jsonl"), "--store", str(tmp_path / "store")]) == 1
    assert f"{tmp_path / 'missing.jsonl'}: file not found" in capsys.readouterr().err


def test_drmas_serve_retrieval_is_the_command(tmp_path, corpus_file, passages, capsys):
    """`drmas serve-retrieval` hands its arguments to the service's command: --help names
    it, --build-only works through it, a missing corpus exits 1 naming the file."""
    from drmas.cli import main as drmas

    with pytest.raises(SystemExit) as help_exit:
        drmas(["serve-retrieval", "--help"])
    assert help_exit.value.code == 0 and "usage: drmas serve-retrieval" in capsys.readouterr().out
    assert drmas(["serve-retrieval", "--corpus", str(corpus_file), "--store", str(tmp_path), "--build-only"]) == 0
    assert f"corpus hash {Retriever.corpus_hash(passages)}" in capsys.readouterr().out
    assert drmas(["serve-retrieval", "--corpus", str(tmp_path / "none.jsonl"), "--store", str(tmp_path)]) == 1
    assert f"{tmp_path / 'none.jsonl'}: file not found" in capsys.readouterr().err


def test_a_resumed_run_may_move_its_search_to_a_service_but_not_change_it(tmp_path):
    """Where the search is served may change on resume (the service checks its corpus);
    what it searches (top-k) may not."""
    from drmas.runner import open_run

    config = search_config(tmp_path)
    store = Store(str(tmp_path / "store"))
    open_run(config, store, "r", resume=False)
    served = config.model_copy(
        update={"task": config.task.model_copy(update={"retrieval_url": "http://127.0.0.1:9", "retrieval_retries": 1})}
    )
    assert open_run(served, store, "r", resume=True) is served
    other = config.model_copy(update={"task": config.task.model_copy(update={"retrieval_top_k": 5})})
    with pytest.raises(ConfigError, match="task.retrieval_top_k"):
        open_run(other, store, "r", resume=True)


def test_build_only_caches_the_index_and_prints_the_hash_to_pin(tmp_path, corpus_file, passages, capsys):
    store = tmp_path / "store"
    assert main(["--corpus", str(corpus_file), "--store", str(store), "--build-only"]) == 0
    corpus_hash = Retriever.corpus_hash(passages)
    assert f"corpus hash {corpus_hash}" in capsys.readouterr().out
    assert Store(str(store)).exists(f"_cache/bm25/{corpus_hash}")


def test_the_command_serves_the_generated_world_a_run_searches(tmp_path):
    """``--corpus generated:facts`` with the run's seed and sizes is the run's corpus."""
    config = search_config(tmp_path)
    data = config.data
    served = load_passages("generated:facts", SEED, data.generated_train_size, data.generated_eval_size)
    assert served == corpus_for(data, SEED)
    with pytest.raises(DataError, match="no such generated corpus"):
        load_passages("generated:arithmetic")


# --------------------------------------------------------------------------------------
# A search rollout through the service
# --------------------------------------------------------------------------------------


class ScriptedPool:
    """A pool whose agents act on what their prompt shows: the Verifier routes to search
    until a passage is shown, the Searcher asks the question, the Answerer copies the last
    word of the first passage. Prompts are returned as their bytes, so two rollouts'
    tables are equal only if every prompt (retrieved passages included) was."""

    def load(self, policies: dict[str, Any]) -> None:
        pass

    def generate(self, wg: str, messages: list[str], sampling: Any, seed: int) -> list[GenerationResult]:
        return [GenerationResult(list(m.encode()), [1, 2], [-0.5, -0.5], self.act(wg, m), "stop") for m in messages]

    @staticmethod
    def act(wg: str, prompt: str) -> str:
        first = re.search(r"Doc 1: (.*)", prompt)
        if wg == "verifier":
            return f"<verify>{'yes' if first else 'no'}</verify>"
        if wg == "search":
            question = re.search(r"Question: (.*)", prompt)
            return f"<think>t</think><search>{question.group(1) if question else ''}</search>"
        return f"<think>t</think><answer>{first.group(1).rstrip('.').split()[-1] if first else 'none'}</answer>"


def search_config(tmp_path: Path, *overrides: str) -> DrmasConfig:
    return load_config(
        ROOT / "configs" / "search_tiny.yaml",
        [
            "workers.sharing=none",
            "rollout.prompts_per_iteration=6",
            "rollout.group_size=2",
            "data.generated_train_size=40",
            "data.generated_eval_size=10",
            f"experiment.seed={SEED}",
            f"store.root={tmp_path / 'runs'}",
            *overrides,
        ],
    )


def test_a_search_rollout_through_the_service_equals_one_in_process(tmp_path):
    """The rollout stage with ``task.retrieval_url`` set writes the same trajectories as
    with the in-process BM25, and builds no index of its own."""
    config = search_config(tmp_path / "local")
    corpus = write_corpus(tmp_path / "corpus.jsonl", corpus_for(config.data, config.experiment.seed))
    local = search_config(tmp_path / "local", f"data.corpus={corpus}")
    passages = corpus_for(local.data, local.experiment.seed)
    with running(serve(passages, Store(str(tmp_path / "service-store")), "127.0.0.1", 0)) as server:
        served = search_config(tmp_path / "served", f"data.corpus={corpus}", f"task.retrieval_url={server.url}")
        tables = {}
        for name, cfg in {"local": local, "served": served}.items():
            store = Store.from_config(cfg.store)
            started = time.perf_counter()
            result = rollout(cfg, store, "run", 0, {}, ScriptedPool())
            tables[name] = store.open(result.artifact).read_table("trajectories.parquet")
            assert time.perf_counter() - started < 30, name
            assert bool(store.list("_cache/bm25")) == (name == "local")
    assert tables["served"].equals(tables["local"])
    prompts = [bytes(ids).decode() for ids in tables["served"]["prompt_ids"].to_pylist()]
    assert any("Doc 1: " in prompt for prompt in prompts)  # passages were retrieved
    assert max(tables["served"]["reward"].to_pylist()) == 1.0  # and they decide rewards


def test_a_dead_service_fails_the_rollout_stage_and_writes_nothing(tmp_path):
    port = free_port()
    config = search_config(
        tmp_path,
        f"task.retrieval_url=http://127.0.0.1:{port}",
        "task.retrieval_retries=1",
        "task.retrieval_backoff_s=0.01",
    )
    store = Store.from_config(config.store)
    with pytest.raises(RetrievalUnavailable, match=rf"http://127\.0\.0\.1:{port} is unavailable"):
        rollout(config, store, "run", 0, {}, ScriptedPool())
    assert not store.exists(stage_path(config.experiment.name, "run", 0, "rollout"))


# --------------------------------------------------------------------------------------
# Retries, timeouts and failures
# --------------------------------------------------------------------------------------


class Flaky(ThreadingHTTPServer):
    """A front of ``upstream`` whose first ``failures`` requests get ``status`` (with
    ``Retry-After: 0``); the others are passed through."""

    daemon_threads = True

    def __init__(self, upstream: str, failures: int, status: int) -> None:
        self.upstream, self.failures, self.status = upstream, failures, status
        self.requests = 0
        self.lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), _FlakyHandler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _FlakyHandler(BaseHTTPRequestHandler):
    server: Flaky

    def _any(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        with self.server.lock:
            self.server.requests += 1
            fail = self.server.requests <= self.server.failures
        if fail:
            status, payload = self.server.status, b'{"error": "warming up"}'
        else:
            forward = urllib.request.Request(
                self.server.upstream + self.path, data=body or None, method=self.command, headers=dict(self.headers)
            )
            try:
                with urllib.request.urlopen(forward, timeout=10) as answer:
                    status, payload = answer.status, answer.read()
            except urllib.error.HTTPError as error:
                status, payload = error.code, error.read()
        self.send_response(status)
        self.send_header("Retry-After", "0")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    do_GET = do_POST = _any

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.mark.parametrize("status", [503, 429, 502])
def test_a_transient_failure_is_retried_then_succeeds(service, passages, status, caplog):
    with running(Flaky(service.url, failures=2, status=status)) as flaky:
        client = RetrievalClient(flaky.url, retries=3, backoff_s=0.01, expected_hash=service.corpus_hash)
        assert client.search(QUERIES, 3) == Retriever.build(passages).search(QUERIES, 3)
        assert flaky.requests == 4  # /health failed twice, then /health and /search
    warnings = [record.getMessage() for record in caplog.records if record.levelname == "WARNING"]
    assert len(warnings) == 2 and all(f"HTTP {status}: warming up" in line for line in warnings)


def test_a_service_that_keeps_failing_fails_clearly_after_the_retries(service):
    with running(Flaky(service.url, failures=100, status=503)) as flaky:
        client = RetrievalClient(flaky.url, retries=2, backoff_s=0.01)
        with pytest.raises(RetrievalUnavailable) as raised:
            client.search(["capital"], 3)
        assert flaky.requests == 3
    message = str(raised.value)
    assert flaky.url in message and "GET /health failed 3 time(s)" in message and "HTTP 503: warming up" in message


def test_a_dead_service_fails_clearly_within_the_timeout(tmp_path):
    """Nothing listens: refused at once, retried with backoff, then the error names the URL."""
    port = free_port()
    config = search_config(
        tmp_path,
        f"task.retrieval_url=http://127.0.0.1:{port}",
        "task.retrieval_timeout_s=2",
        "task.retrieval_retries=2",
        "task.retrieval_backoff_s=0.05",
    )
    retriever = SearchTask().tools(config, Store(str(tmp_path / "store"))).retriever
    started = time.monotonic()
    with pytest.raises(RetrievalUnavailable) as raised:
        retriever.search(["capital"], 3)
    assert time.monotonic() - started < 2
    assert f"retrieval service http://127.0.0.1:{port} is unavailable" in str(raised.value)
    assert "failed 3 time(s)" in str(raised.value) and "connection refused" in str(raised.value)


def test_a_silent_service_times_out(tmp_path):
    """A service that accepts connections but never answers: each attempt ends at the
    timeout, and the whole call within (attempts x timeout + backoff)."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        client = RetrievalClient(url, timeout_s=0.3, retries=1, backoff_s=0.01)
        started = time.monotonic()
        with pytest.raises(RetrievalUnavailable, match=r"no answer within 0\.3 s"):
            client.search(["capital"], 3)
        assert 0.6 <= time.monotonic() - started < 3


# --------------------------------------------------------------------------------------
# The corpus check
# --------------------------------------------------------------------------------------


def test_a_service_on_another_corpus_is_refused(service, tmp_path):
    """The config names one corpus, the service serves another: refused on first use,
    both hashes named; a pinned hash is checked the same way, without reading the corpus."""
    other = write_corpus(tmp_path / "other.jsonl", generate_fact_world(SEED + 1, entities=5)[0])
    config = search_config(tmp_path, f"data.corpus={other}", f"task.retrieval_url={service.url}")
    with pytest.raises(RetrievalMismatch) as raised:
        retrieval_client(config).search(["capital"], 3)
    expected = Retriever.corpus_hash(generate_fact_world(SEED + 1, entities=5)[0])
    assert service.corpus_hash in str(raised.value) and expected in str(raised.value)
    assert service.url in str(raised.value)

    missing = tmp_path / "not-here.jsonl"  # a pinned hash never reads data.corpus
    pinned = search_config(
        tmp_path,
        f"data.corpus={missing}",
        f"task.retrieval_url={service.url}",
        f"task.retrieval_corpus_hash={service.corpus_hash}",
    )
    assert retrieval_client(pinned).search(["capital"], 1)[0]
    wrong = pinned.model_copy(update={"task": pinned.task.model_copy(update={"retrieval_corpus_hash": "0" * 64})})
    with pytest.raises(RetrievalMismatch, match="0" * 64):
        retrieval_client(wrong).search(["capital"], 1)


def test_a_service_tokenised_otherwise_is_refused_and_one_alike_is_used(passages, corpus_file, tmp_path):
    """The same corpus served stemmed: a config without stemming is refused, naming both
    tokenisations' sides; a config with it searches the service and gets what its own
    stemmed retriever finds (here more than the unstemmed one)."""
    stemmed = Tokenization(stemmer="english")
    with running(serve(passages, Store(str(tmp_path / "service-store")), "127.0.0.1", 0, stemmed)) as server:
        plain = search_config(tmp_path, f"data.corpus={corpus_file}", f"task.retrieval_url={server.url}")
        with pytest.raises(RetrievalMismatch) as raised:
            retrieval_client(plain).search(["capital"], 3)
        assert "'stemmer': 'english'" in str(raised.value) and "task.retrieval_stemmer" in str(raised.value)
        alike = search_config(
            tmp_path, f"data.corpus={corpus_file}", f"task.retrieval_url={server.url}", "task.retrieval_stemmer=english"
        )
        queries = ["capitals", "founding", "towns"]
        served = retrieval_client(alike).search(queries, 3)
        assert served == Retriever.build(passages, stemmed).search(queries, 3)
        assert all(served) and Retriever.build(passages).search(queries, 3) == [[], [], []]


def test_the_command_serves_stemmed_with_its_flags(tmp_path, corpus_file, passages, capsys):
    store = tmp_path / "store"
    flags = ["--stemmer", "english", "--stopwords", "none"]
    assert main(["--corpus", str(corpus_file), "--store", str(store), "--build-only", *flags]) == 0
    corpus_hash = Retriever.corpus_hash(passages, Tokenization("english", "none"))
    assert corpus_hash != Retriever.corpus_hash(passages)
    assert f"corpus hash {corpus_hash}" in capsys.readouterr().out
    assert Store(str(store)).list("_cache/bm25") == [f"_cache/bm25/{corpus_hash}"]


def test_a_service_restarted_on_another_corpus_is_refused(service, passages):
    client = RetrievalClient(service.url, expected_hash=Retriever.corpus_hash(passages))
    assert client.search(["capital"], 1)[0]
    service.corpus_hash = "f" * 64  # as if another corpus now answered at the same URL
    with pytest.raises(RetrievalMismatch, match="restarted on another corpus"):
        client.search(["capital"], 1)


# --------------------------------------------------------------------------------------
# Bad requests
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"not json", "the body is not JSON"),
        (b"\xff\xfe", "the body is not JSON"),
        (b'["capital"]', "expected a JSON object"),
        (b'{"k": 3}', "'queries' must be a list of strings, got NoneType"),
        (b'{"queries": "capital", "k": 3}', "'queries' must be a list of strings, got str"),
        (b'{"queries": ["capital", 7], "k": 3}', "queries[1] must be a string, got int"),
        (b'{"queries": ["capital"]}', "'k' must be an integer from 1 to 1000, got None"),
        (b'{"queries": ["capital"], "k": 0}', "'k' must be an integer from 1 to 1000, got 0"),
        (b'{"queries": ["capital"], "k": true}', "got True"),
        (b'{"queries": ["capital"], "k": 2.5}', "got 2.5"),
        (b'{"queries": ["capital"], "k": 1001}', "got 1001"),
        (b'{"queries": [], "k": 3, "top_k": 3}', "unknown field(s) top_k"),
        (json.dumps({"queries": ["q"] * 4097, "k": 1}).encode(), "at most 4096 queries per request, got 4097"),
    ],
)
def test_a_bad_request_gets_400_with_a_message(service, body, message):
    status, answer = post(service.url, "/search", body)
    assert status == 400
    assert message in answer["error"]


def post(url: str, path: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        connection.request("POST", path, body, headers or {"Content-Type": "application/json"})
        answer = connection.getresponse()
        return answer.status, json.loads(answer.read())
    finally:
        connection.close()


def test_unknown_paths_and_oversized_bodies_are_refused(service):
    assert post(service.url, "/query", b"{}")[0] == 404
    status, answer = post(service.url, "/search", b"", {"Content-Length": str(64 * 1024 * 1024)})
    assert status == 413 and "send fewer queries per request" in answer["error"]
    with pytest.raises(urllib.error.HTTPError) as raised:
        urllib.request.urlopen(f"{service.url}/metrics", timeout=10)
    assert raised.value.code == 404


def test_the_client_does_not_retry_a_refused_request(service):
    """A 400 is the client's mistake: raised at once, with the service's message."""
    with running(Flaky(service.url, failures=0, status=200)) as front:
        client = RetrievalClient(front.url, retries=3, backoff_s=0.01)
        client.check()
        with pytest.raises(RetrievalError, match=r"refused POST /search: HTTP 400: at most 4096 queries"):
            client._request("POST", "/search", {"queries": ["q"] * 4097, "k": 1})
        assert front.requests == 2
    with pytest.raises(ValueError, match="k must be at least 1"):
        client.search(["capital"], 0)


# --------------------------------------------------------------------------------------
# Config and cache keys
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url", ["http://user:secret@retrieval:8080", "ftp://retrieval", "retrieval:8080", "http://retrieval/?token=x"]
)
def test_the_retrieval_url_holds_no_credentials_and_is_http(tmp_path, url):
    with pytest.raises(ConfigError, match=r"task\.retrieval_url: must look like http\(s\)://host:port"):
        search_config(tmp_path, f"task.retrieval_url={url}")


def test_cache_keys_follow_the_corpus_not_where_it_is_served(tmp_path):
    """Served or in process, the passages are the same (the client checks the corpus
    hash), so a rollout or an evaluation cached in process is reused through a service and
    back; a change of corpus is a new key."""
    store = Store(str(tmp_path / "store"))
    base = search_config(tmp_path, "data.corpus=a.jsonl")
    served = search_config(
        tmp_path,
        "data.corpus=a.jsonl",
        "task.retrieval_url=http://drmas-retrieval.drmas.svc.cluster.local:8080",
        "task.retrieval_timeout_s=5",
        "task.retrieval_retries=9",
        "task.retrieval_backoff_s=2",
        f"task.retrieval_corpus_hash={'a' * 64}",
    )
    other_corpus = search_config(tmp_path, "data.corpus=b.jsonl")
    more_passages = search_config(tmp_path, "task.retrieval_top_k=5")
    stemmed = search_config(tmp_path, "data.corpus=a.jsonl", "task.retrieval_stemmer=english")
    for contract in (RolloutContract("run", 0, {}), EvaluateContract("exp/run/iter-000000", {})):
        key = cache_key(base, store, contract)
        assert cache_key(served, store, contract) == key, contract.name
        assert cache_key(other_corpus, store, contract) != key, contract.name
        assert cache_key(more_passages, store, contract) != key, contract.name
        assert cache_key(stemmed, store, contract) != key, contract.name
