"""Retrieval as a service: the search task's BM25 served over HTTP, and its command line.

The reference serves retrieval from a separate server (e5 + FAISS over wiki-18, ~21M
passages); by default drmas builds a BM25 index in the rollout driver's own process. At
wiki scale that index belongs in one service that every rollout and evaluation shares:

    drmas serve-retrieval --corpus PATH --store ROOT --port 8080
    python -m drmas.tasks.search.service --corpus PATH --store ROOT --port 8080   # the same

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
3. Runs reach it through ``drmas.tasks.search.client.RetrievalClient`` (``task.retrieval_url``),
   which retries, and fails rather than answer with no passages.

This module is the server and its command line only: what it serves (the retriever, the
corpus) and the client it shares its limits with are modules of their own, and in the
library only the command line imports this one.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import socket
import sys
import threading
from collections.abc import Sequence
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from drmas.config import DataConfig
from drmas.infra.store import Store, StoreError
from drmas.tasks import DataError
from drmas.tasks.search.client import MAX_QUERIES
from drmas.tasks.search.corpus import corpus_for, load_corpus
from drmas.tasks.search.retrieval import INDEX_FORMAT, Retriever, Tokenization, cached_retriever
from drmas.tasks.search.world import GENERATED_FACTS, GENERATED_PREFIX
from drmas.team.orchestras import Passage

__all__ = [
    "DEFAULT_PORT",
    "RetrievalServer",
    "load_passages",
    "main",
    "serve",
]

logger = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080
MAX_BODY_BYTES = 16 * 1024 * 1024
"""The largest /search request body the server reads."""
MAX_K = 1000
"""The most passages per query one request may ask for."""


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
