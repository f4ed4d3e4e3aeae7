"""Retrieval as a service: the search task's BM25 served over HTTP, and its client.

The reference serves retrieval from a separate server (e5 + FAISS over wiki-18, ~21M
passages); by default drmas builds a BM25 index in the rollout driver's own process. At
wiki scale that index belongs in one service that every rollout and evaluation shares:

    python -m drmas.tasks.retrieval_service --corpus PATH --store ROOT --port 8080

1. The server loads the corpus and its index exactly as the in-process path does
   (``load_corpus``, then ``cached_retriever``: built once, cached in the store under
   ``_cache/bm25/{corpus_hash}``, loaded without unpickling), tokenised as ``--stemmer``
   and ``--stopwords`` say (``task.retrieval_stemmer``/``retrieval_stopwords``; the corpus
   hash holds them), so a served search returns what ``Retriever.search`` returns. It
   binds 127.0.0.1 unless told otherwise (``--host``).
2. Its API is JSON:

       GET  /health -> {"status": "ok", "corpus_hash": H, "passages": N, "format": F,
                        "tokenization": {"stemmer": S, "stopwords": W}}
       POST /search {"queries": ["...", ...], "k": 3}
                    -> {"corpus_hash": H, "results": [[{"id": ..., "text": ...}, ...], ...]}

   A malformed request gets 400 with {"error": "..."} saying what is wrong; a body over
   ``MAX_BODY_BYTES`` gets 413; an unknown path 404.
3. ``RetrievalClient`` has ``Retriever``'s ``search(queries, k)``; the search task uses it
   when ``task.retrieval_url`` is set. On first use it checks that the service serves the
   corpus the config names (``RetrievalMismatch`` otherwise), and every answer must carry
   that corpus's hash. A connection error, a timeout, a 5xx or a 429 is retried
   ``retries`` times, waiting ``backoff_s``, then twice as long each time (at most
   ``MAX_BACKOFF_S``; a longer ``Retry-After`` is honoured up to that); then
   ``RetrievalUnavailable`` names the URL, the request, the attempts and the last failure.
   A failure never comes back as an empty result: an episode would silently lose its
   passages, and the run would learn from that.
"""

from __future__ import annotations

import argparse
import http.client
import json
import logging
import signal
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from drmas.config import DataConfig
from drmas.infra.store import Store, StoreError
from drmas.tasks import DataError
from drmas.tasks.search import (
    GENERATED_FACTS,
    GENERATED_PREFIX,
    INDEX_FORMAT,
    Passage,
    Retriever,
    Tokenization,
    cached_retriever,
    corpus_for,
    corpus_hash_for,
    load_corpus,
)

if TYPE_CHECKING:
    from drmas.config import DrmasConfig

__all__ = [
    "DEFAULT_PORT",
    "RetrievalClient",
    "RetrievalError",
    "RetrievalMismatch",
    "RetrievalServer",
    "RetrievalUnavailable",
    "load_passages",
    "main",
    "serve",
]

logger = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080
MAX_BODY_BYTES = 16 * 1024 * 1024
"""The largest /search request body the server reads."""
MAX_QUERIES = 4096
"""The most queries one /search request may hold (the client sends batches of fewer)."""
MAX_K = 1000
"""The most passages per query one request may ask for."""
MAX_BACKOFF_S = 30.0
"""The longest wait between two attempts of a request."""
RETRIED_STATUSES = frozenset({429, 500, 502, 503, 504})
"""Answers worth another attempt: overloaded, restarting or behind a proxy that is. Other
5xx are retried too; a 4xx other than 429 is the client's mistake and is not."""


class RetrievalError(RuntimeError):
    """The retrieval service refused a request or answered something that is not an answer."""


class RetrievalUnavailable(RetrievalError):
    """The retrieval service could not be reached, or failed, within the retries."""


class RetrievalMismatch(RetrievalError):
    """The retrieval service serves another corpus than the one the config names."""


# --------------------------------------------------------------------------------------
# The server
# --------------------------------------------------------------------------------------


class _BadRequest(ValueError):
    def __init__(self, message: str, status: HTTPStatus = HTTPStatus.BAD_REQUEST) -> None:
        super().__init__(message)
        self.status = status


def _search_request(body: bytes) -> tuple[list[str], int]:
    """(queries, k) of a /search body, or _BadRequest saying what is wrong with it."""
    try:
        request = json.loads(body)
    except (UnicodeDecodeError, ValueError) as error:
        raise _BadRequest(f"the body is not JSON ({error})") from None
    if not isinstance(request, dict):
        raise _BadRequest(f'expected a JSON object {{"queries": [...], "k": N}}, got {type(request).__name__}')
    unknown = sorted(set(request) - {"queries", "k"})
    if unknown:
        raise _BadRequest(f"unknown field(s) {', '.join(unknown)} (expected queries and k)")
    queries, k = request.get("queries"), request.get("k")
    if not isinstance(queries, list):
        raise _BadRequest(f"'queries' must be a list of strings, got {type(queries).__name__}")
    if len(queries) > MAX_QUERIES:
        raise _BadRequest(f"at most {MAX_QUERIES} queries per request, got {len(queries)}")
    wrong = next((position for position, query in enumerate(queries) if not isinstance(query, str)), None)
    if wrong is not None:
        raise _BadRequest(f"queries[{wrong}] must be a string, got {type(queries[wrong]).__name__}")
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_K:
        raise _BadRequest(f"'k' must be an integer from 1 to {MAX_K}, got {k!r}")
    return queries, k


class _Handler(BaseHTTPRequestHandler):
    server: RetrievalServer
    server_version = "drmas-retrieval"

    def do_GET(self) -> None:
        if self.path.split("?", 1)[0] != "/health":
            self._reply(HTTPStatus.NOT_FOUND, {"error": f"no such path {self.path!r} (GET /health, POST /search)"})
            return
        self._reply(HTTPStatus.OK, self.server.health())

    def do_POST(self) -> None:
        if self.path.split("?", 1)[0] != "/search":
            self._reply(HTTPStatus.NOT_FOUND, {"error": f"no such path {self.path!r} (GET /health, POST /search)"})
            return
        try:
            queries, k = _search_request(self._body())
        except _BadRequest as error:
            self._reply(error.status, {"error": str(error)})
            return
        try:
            found = self.server.retriever.search(queries, k)
        except Exception as error:
            logger.exception("search of %d queries failed", len(queries))
            self._reply(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": f"search failed: {type(error).__name__}: {error}"})
            return
        results = [[{"id": passage.pid, "text": passage.text} for passage in passages] for passages in found]
        self._reply(HTTPStatus.OK, {"corpus_hash": self.server.corpus_hash, "results": results})

    def _body(self) -> bytes:
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            raise _BadRequest("a Content-Length header is required", HTTPStatus.LENGTH_REQUIRED)
        if int(length) > MAX_BODY_BYTES:
            raise _BadRequest(
                f"the body has {length} bytes, more than {MAX_BODY_BYTES}: send fewer queries per request",
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
            )
        return self.rfile.read(int(length))

    def _reply(self, status: HTTPStatus, payload: dict[str, Any]) -> None:
        body = json.dumps(payload, ensure_ascii=False).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        """Requests go to the module's logger at debug (http.server writes every one to
        stderr); bodies and headers are never logged."""
        logger.debug("%s %s", self.address_string(), format % args)


class RetrievalServer(ThreadingHTTPServer):
    """``retriever`` served on ``(host, port)`` (port 0: any free port; ``url`` says
    which). ``serve_forever()`` answers until ``shutdown()``; each request has a thread."""

    daemon_threads = True

    def __init__(self, retriever: Retriever, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT) -> None:
        self.retriever = retriever
        self.corpus_hash = Retriever.corpus_hash(retriever.passages, retriever.tokenization)
        if ":" in host:
            self.address_family = socket.AF_INET6
        super().__init__((host, port), _Handler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        host = str(host)
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def health(self) -> dict[str, Any]:
        return {
            "status": "ok",
            "corpus_hash": self.corpus_hash,
            "passages": len(self.retriever.passages),
            "format": INDEX_FORMAT,
            "tokenization": self.retriever.tokenization.describe(),
        }


def load_passages(
    corpus: str,
    seed: int = 0,
    generated_train_size: int | None = None,
    generated_eval_size: int | None = None,
    store: Store | None = None,
) -> list[Passage]:
    """The passages that ``corpus`` names: a JSONL file, local or ``s3://`` (read with
    ``store``'s S3 settings; ``load_corpus``), or ``generated:facts``, the world a run with
    this seed and these sizes searches."""
    if not corpus.startswith(GENERATED_PREFIX):
        return load_corpus(corpus, store)
    if corpus != f"{GENERATED_PREFIX}{GENERATED_FACTS}":
        raise DataError(f"{corpus}: no such generated corpus (available: {GENERATED_PREFIX}{GENERATED_FACTS})")
    sizes = {"generated_train_size": generated_train_size, "generated_eval_size": generated_eval_size}
    return corpus_for(DataConfig.model_validate({name: size for name, size in sizes.items() if size is not None}), seed)


def serve(
    passages: list[Passage],
    store: Store,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    tokenization: Tokenization | None = None,
) -> RetrievalServer:
    """A server (not yet serving: call ``serve_forever``) for ``passages``, its index
    loaded from, or built into, ``store``'s cache as the in-process retriever's is
    (``tokenization``: as ``Retriever``'s, bm25s's English stop words and no stemmer)."""
    return RetrievalServer(cached_retriever(passages, store, tokenization or Tokenization()), host, port)


# --------------------------------------------------------------------------------------
# The client
# --------------------------------------------------------------------------------------


def _retry_after(headers: Any) -> float | None:
    value = headers.get("Retry-After") if headers is not None else None
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None  # an HTTP date: the exponential backoff decides


def _error_text(error: urllib.error.HTTPError) -> str:
    """The service's own message from an error answer, or the status's phrase."""
    try:
        body = error.read(4096)
        message = json.loads(body).get("error")
    except (OSError, ValueError, AttributeError, http.client.HTTPException):
        message = None
    return str(message) if message else str(error.reason)


def _failure(error: BaseException, timeout_s: float) -> str:
    reason = error.reason if isinstance(error, urllib.error.URLError) else error
    if isinstance(reason, TimeoutError | socket.timeout):
        return f"no answer within {timeout_s:g} s (task.retrieval_timeout_s)"
    if isinstance(reason, ConnectionRefusedError):
        return "connection refused"
    return f"{type(reason).__name__}: {reason}" if isinstance(reason, BaseException) else str(reason)


class RetrievalClient:
    """A retrieval service's ``search(queries, k)``, the same as ``Retriever.search``.

    ``expected_hash`` is the corpus hash the service must serve (or a function computing
    it on first use; None: not checked). A request is retried ``retries`` times after a
    connection error, a timeout (``timeout_s`` per attempt), a 5xx or a 429; queries go in
    batches of at most ``batch_size`` per request. Thread-safe.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 60.0,
        retries: int = 4,
        backoff_s: float = 0.5,
        expected_hash: str | Callable[[], str] | None = None,
        batch_size: int = 64,
    ) -> None:
        if not 1 <= batch_size <= MAX_QUERIES:
            raise ValueError(f"batch_size must be from 1 to {MAX_QUERIES}, got {batch_size}")
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.batch_size = batch_size
        self._expected = expected_hash
        self._served: str | None = None
        self._lock = threading.Lock()
        # No proxy from the environment: the service is in the cluster (or on this host),
        # and a proxy variable meant for the internet must not route it elsewhere.
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    @classmethod
    def for_config(cls, config: DrmasConfig) -> RetrievalClient:
        """The client of ``task.retrieval_url`` with the config's timeout and retries,
        checking the corpus the config names, tokenised as it says
        (``task.retrieval_corpus_hash`` if pinned)."""
        task, data, seed = config.task, config.data, config.experiment.seed
        if task.retrieval_url is None:
            raise ValueError("task.retrieval_url is not set: the search task retrieves in process")
        expected: str | Callable[[], str] = task.retrieval_corpus_hash or (
            lambda: corpus_hash_for(data, seed, config.store, Tokenization.of(task))
        )
        return cls(
            task.retrieval_url,
            timeout_s=task.retrieval_timeout_s,
            retries=task.retrieval_retries,
            backoff_s=task.retrieval_backoff_s,
            expected_hash=expected,
        )

    def __repr__(self) -> str:
        return f"RetrievalClient({self.url!r})"

    def health(self) -> dict[str, Any]:
        """The service's ``GET /health`` answer (retried like every request)."""
        answer = self._request("GET", "/health", None)
        if not isinstance(answer, dict) or not isinstance(answer.get("corpus_hash"), str):
            raise RetrievalUnavailable(f"retrieval service {self.url}: GET /health answered without a corpus_hash")
        return answer

    def check(self) -> str:
        """The hash of the corpus the service serves, checked (once) against the expected
        one; RetrievalMismatch when they differ."""
        with self._lock:
            if self._served is None:
                health = self.health()
                served = str(health["corpus_hash"])
                expected = self._expected() if callable(self._expected) else self._expected
                if expected is not None and served != expected:
                    raise RetrievalMismatch(
                        f"retrieval service {self.url} serves another corpus than this config names: "
                        f"it serves corpus hash {served} ({health.get('passages')} passages, tokenization "
                        f"{health.get('tokenization', 'unreported')}), the config's corpus (data.corpus, or the "
                        f"generated world, tokenised as task.retrieval_stemmer/retrieval_stopwords say) hashes "
                        f"to {expected}. Start the service on the config's corpus with its --stemmer and "
                        "--stopwords, or point task.retrieval_url at one that serves it."
                    )
                self._served = served
            return self._served

    def search(self, queries: list[str], k: int) -> list[list[Passage]]:
        """The best ``k`` passages for each query, best first (``Retriever.search``)."""
        if k < 1:
            raise ValueError(f"k must be at least 1, got {k}")
        served = self.check()
        results: list[list[Passage]] = []
        for start in range(0, len(queries), self.batch_size):
            batch = list(queries[start : start + self.batch_size])
            answer = self._request("POST", "/search", {"queries": batch, "k": k})
            results += self._passages(answer, len(batch), served)
        return results

    def _passages(self, answer: Any, count: int, served: str) -> list[list[Passage]]:
        where = f"retrieval service {self.url}: POST /search"
        if not isinstance(answer, dict) or not isinstance(answer.get("results"), list):
            raise RetrievalUnavailable(f"{where} answered without a results list")
        if answer.get("corpus_hash") != served:
            raise RetrievalMismatch(
                f"{where} answered from corpus hash {answer.get('corpus_hash')}, not {served} that it served "
                "when first checked (was it restarted on another corpus?)"
            )
        results = answer["results"]
        if len(results) != count:
            raise RetrievalUnavailable(f"{where} answered {len(results)} result lists for {count} queries")
        try:
            return [[Passage(str(hit["id"]), str(hit["text"])) for hit in hits] for hits in results]
        except (TypeError, KeyError) as error:
            raise RetrievalUnavailable(f"{where} answered a malformed passage ({error!r})") from None

    def _request(self, method: str, path: str, payload: dict[str, Any] | None) -> Any:
        """The JSON answer to one request, retried as the class says."""
        data = None if payload is None else json.dumps(payload).encode()
        started, failure, wait_hint = time.monotonic(), "", None
        for attempt in range(self.retries + 1):
            if attempt:
                wait = min(MAX_BACKOFF_S, self.backoff_s * 2 ** (attempt - 1))
                time.sleep(min(MAX_BACKOFF_S, max(wait, wait_hint or 0.0)))
            request = urllib.request.Request(
                f"{self.url}{path}",
                data=data,
                method=method,
                headers={"Content-Type": "application/json", "Accept": "application/json"},
            )
            wait_hint = None
            try:
                with self._opener.open(request, timeout=self.timeout_s) as response:
                    body = response.read()
            except urllib.error.HTTPError as error:
                if error.code in RETRIED_STATUSES or error.code >= 500:
                    failure, wait_hint = f"HTTP {error.code}: {_error_text(error)}", _retry_after(error.headers)
                    logger.warning(
                        "retrieval service %s: %s %s: %s (attempt %d)", self.url, method, path, failure, attempt + 1
                    )
                    continue
                raise RetrievalError(
                    f"retrieval service {self.url} refused {method} {path}: HTTP {error.code}: {_error_text(error)}"
                ) from None
            except (urllib.error.URLError, http.client.HTTPException, OSError) as error:
                failure = _failure(error, self.timeout_s)
                logger.warning(
                    "retrieval service %s: %s %s: %s (attempt %d)", self.url, method, path, failure, attempt + 1
                )
                continue
            try:
                return json.loads(body)
            except ValueError:
                raise RetrievalUnavailable(
                    f"retrieval service {self.url}: {method} {path} answered something that is not JSON "
                    f"({body[:80]!r}): is task.retrieval_url the retrieval service?"
                ) from None
        attempts = self.retries + 1
        raise RetrievalUnavailable(
            f"retrieval service {self.url} is unavailable: {method} {path} failed {attempts} time(s) in "
            f"{time.monotonic() - started:.1f} s; last: {failure}. Is the service running (drmas "
            "serve-retrieval) and is task.retrieval_url right?"
        )


# --------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="drmas serve-retrieval",
        description="Serve the search task's BM25 retrieval over HTTP (GET /health, POST /search).",
    )
    parser.add_argument(
        "--corpus",
        required=True,
        help="the corpus: a JSONL file of passages (as data.corpus), or generated:facts (the generated world)",
    )
    parser.add_argument(
        "--store",
        default="./runs",
        help="artifact root (a folder or s3://bucket/prefix) whose _cache/bm25 holds the index (default ./runs)",
    )
    parser.add_argument(
        "--store-endpoint",
        default=None,
        help="S3 endpoint URL for an s3:// store; unset: $DRMAS_S3_ENDPOINT, then $AWS_ENDPOINT_URL",
    )
    parser.add_argument(
        "--host", default=DEFAULT_HOST, help=f"address to bind (default {DEFAULT_HOST}; 0.0.0.0 in a cluster pod)"
    )
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT}; 0: any free)")
    parser.add_argument(
        "--stemmer",
        choices=["none", "english"],
        default="none",
        help="stem BM25 terms (task.retrieval_stemmer; default none): the runs' configs must say the same",
    )
    parser.add_argument(
        "--stopwords",
        choices=["none", "english"],
        default="english",
        help="drop these stop words (task.retrieval_stopwords; default english): as the runs' configs say",
    )
    parser.add_argument(
        "--build-only",
        action="store_true",
        help="build (or check) the index cache in the store, print the corpus hash, and exit without serving",
    )
    generated = parser.add_argument_group("generated:facts only: the run's experiment.seed and data sizes")
    generated.add_argument("--seed", type=int, default=0, help="experiment.seed (default 0)")
    generated.add_argument("--generated-train-size", type=int, default=None, help="data.generated_train_size")
    generated.add_argument("--generated-eval-size", type=int, default=None, help="data.generated_eval_size")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """``drmas serve-retrieval``: load the corpus and its index, then answer until SIGTERM
    or Ctrl-C. Prints one line when ready (URL, passages, corpus hash). With
    ``--build-only``, only makes sure the store caches the index (a Kubernetes Job before
    the Deployment: the first build of a large corpus takes long), and prints the hash to
    pin as ``task.retrieval_corpus_hash``."""
    args = _parser().parse_args(argv)
    try:
        store = Store(args.store, args.store_endpoint)
        # No reference to the loaded passages is kept: the server holds its retriever's
        # (at wiki scale, a second copy would double the service's memory).
        passages = load_passages(args.corpus, args.seed, args.generated_train_size, args.generated_eval_size, store)
        tokenization = Tokenization(args.stemmer, args.stopwords)
        if args.build_only:
            retriever = cached_retriever(passages, store, tokenization)
            print(f"drmas serve-retrieval: {len(retriever.passages)} passages of {args.corpus} indexed in {store.root}")
            print(f"corpus hash {Retriever.corpus_hash(retriever.passages, tokenization)}", flush=True)
            return 0
        server = serve(passages, store, args.host, args.port, tokenization)
        del passages
    except (ValueError, OSError, StoreError) as error:
        print(f"drmas serve-retrieval: {error}", file=sys.stderr)
        return 1
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown, daemon=True).start())
    print(
        f"drmas serve-retrieval: {server.url} serves {len(server.retriever.passages)} passages of {args.corpus} "
        f"(corpus hash {server.corpus_hash})",
        flush=True,
    )
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("bm25s").setLevel(logging.WARNING)
    raise SystemExit(main())
