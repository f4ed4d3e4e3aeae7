"""The client of a retrieval service (``drmas serve-retrieval``, ``drmas.tasks.search.service``):
``search(queries, k)`` over HTTP, answering as the in-process ``Retriever`` does, with
retries, batching and a check that the service serves the corpus the run names.

The search task uses it when ``task.retrieval_url`` is set. On first use it checks that
the service retrieves as the config says (BM25 or dense: ``task.retrieval_method``) from
the corpus the config names, indexed with its settings (``RetrievalMismatch`` otherwise,
saying what the service and the config each have), and every answer must carry that
corpus's hash. A connection error, a timeout, a 5xx or a
429 is retried ``retries`` times, waiting ``backoff_s``, then twice as long each time
(at most ``MAX_BACKOFF_S``; a longer ``Retry-After`` is honoured up to that); then
``RetrievalUnavailable`` names the URL, the request, the attempts and the last failure.
A failure never comes back as an empty result: an episode would silently lose its
passages, and the run would learn from that.

Its own module so that the search task (which builds a client when ``task.retrieval_url``
is set) and the service (which shares its limits) both import it, and neither imports the
other's side.
"""

from __future__ import annotations

import http.client
import json
import logging
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from drmas.team.orchestras import Passage

__all__ = [
    "MAX_QUERIES",
    "RetrievalClient",
    "RetrievalError",
    "RetrievalMismatch",
    "RetrievalUnavailable",
]

logger = logging.getLogger(__name__)


MAX_QUERIES = 4096
"""The most queries one /search request may hold (the client sends batches of fewer)."""


QUERIES_PER_REQUEST = 64
"""Queries per /search request by default: ``drmas.tasks.search.dense.QUERY_BATCH`` too (a
test holds them equal), so that a served dense search sees the very batches an in-process one
does (a query's vector, and so the order of near-ties, may depend in its last bits on the
batch it is encoded with)."""


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
    it on first use; None: not checked); ``expected_method`` the retrieval method it must
    use (bm25 or dense; None: not checked), whose ``expected_settings`` the messages show
    beside the service's. A request is retried ``retries`` times after a
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
        expected_method: str | None = None,
        expected_settings: dict[str, Any] | None = None,
        batch_size: int = QUERIES_PER_REQUEST,
    ) -> None:
        if not 1 <= batch_size <= MAX_QUERIES:
            raise ValueError(f"batch_size must be from 1 to {MAX_QUERIES}, got {batch_size}")
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.batch_size = batch_size
        self._expected = expected_hash
        self._expected_method = expected_method
        self._expected_settings = expected_settings
        self._served: str | None = None
        self._lock = threading.Lock()
        # No proxy from the environment: the service is in the cluster (or on this host),
        # and a proxy variable meant for the internet must not route it elsewhere.
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

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
        method, then the expected hash; RetrievalMismatch when either differs."""
        with self._lock:
            if self._served is None:
                health = self.health()
                served = str(health["corpus_hash"])
                # A service from before dense retrieval reports no method: it serves BM25.
                method = str(health.get("method", "bm25"))
                settings = health.get("settings", health.get("tokenization", "unreported"))
                wanted = f" with {self._expected_settings}" if self._expected_settings is not None else ""
                if self._expected_method is not None and method != self._expected_method:
                    raise RetrievalMismatch(
                        f"retrieval service {self.url} serves {method} retrieval (settings {settings}), but this "
                        f"config's task.retrieval_method is {self._expected_method}{wanted}. Start the service "
                        f"with --method {self._expected_method} and the config's settings, or point "
                        "task.retrieval_url at one that serves them."
                    )
                expected = self._expected() if callable(self._expected) else self._expected
                if expected is not None and served != expected:
                    raise RetrievalMismatch(
                        f"retrieval service {self.url} serves another corpus or index than this config names: "
                        f"it serves corpus hash {served} ({health.get('passages')} passages, {method} retrieval, "
                        f"settings {settings}), the config's corpus (data.corpus, or the generated world) "
                        f"indexed as its task.retrieval_* settings say{wanted} (bm25: task.retrieval_stemmer and "
                        "retrieval_stopwords; dense: task.retrieval_encoder's weights, retrieval_max_length and "
                        f"the prefixes) hashes to {expected}. Start the service on the config's corpus with the "
                        "same settings (--method, --stemmer, --stopwords, --encoder, ...), or point "
                        "task.retrieval_url at one that serves it."
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
