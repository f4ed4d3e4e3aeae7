"""Retrieval as a service: the search task's retrieval served over HTTP, and its command line.

The reference serves retrieval from a separate server (e5 + FAISS over wiki-18, ~21M
passages); by default drmas builds its index in the rollout driver's own process. At
wiki scale that index belongs in one service that every rollout and evaluation shares:

    drmas serve-retrieval --corpus PATH --store ROOT --port 8080
    drmas serve-retrieval --corpus PATH --store ROOT --method dense --encoder intfloat/e5-base-v2
    python -m drmas.tasks.search.service --corpus PATH --store ROOT --port 8080   # the same

1. The server loads the corpus and its index exactly as the in-process path does
   (``load_corpus``, then ``cached_retriever``: built once, cached in the store under
   ``_cache/bm25/{corpus_hash}`` or ``_cache/dense/{corpus_hash}``, loaded without
   unpickling), indexed as its flags say: ``--method`` (``task.retrieval_method``), BM25's
   ``--stemmer`` and ``--stopwords``, the dense encoder's ``--encoder``, ``--max-length``
   and prefixes (``task.retrieval_*``; the corpus hash holds them all), so a served search
   returns what the in-process one returns. It binds 127.0.0.1 unless told otherwise
   (``--host``).
2. Its API is JSON:

       GET  /health -> {"status": "ok", "corpus_hash": H, "passages": N, "format": F,
                        "method": "bm25", "settings": {"stemmer": S, "stopwords": W}}
                       (dense: "method": "dense", "settings": {"encoder": E, "fingerprint":
                        its weights' sha256, "max_length": L, "query_prefix": Q,
                        "passage_prefix": P})
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
from drmas.tasks.search.dense import DenseEncoding
from drmas.tasks.search.retrieval import IndexMethod, SearchIndex, Tokenization, cached_retriever, corpus_hash
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

    def __init__(self, retriever: SearchIndex, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT) -> None:
        self.retriever = retriever
        self.corpus_hash = corpus_hash(retriever.passages, retriever.method)
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
            "format": self.retriever.method.format,
            "method": self.retriever.method.name,
            "settings": self.retriever.method.describe(),
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
    method: IndexMethod | None = None,
) -> RetrievalServer:
    """A server (not yet serving: call ``serve_forever``) for ``passages``, its index
    loaded from, or built into, ``store``'s cache as the in-process retriever's is
    (``method``: BM25 by default, with bm25s's English stop words and no stemmer; or a
    loaded dense ``Encoder``)."""
    return RetrievalServer(cached_retriever(passages, store, method or Tokenization()), host, port)


# --------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="drmas serve-retrieval",
        description="Serve the search task's retrieval (BM25 or dense) over HTTP (GET /health, POST /search).",
    )
    parser.add_argument(
        "--corpus",
        required=True,
        help="the corpus: a JSONL file of passages (as data.corpus), or generated:facts (the generated world)",
    )
    parser.add_argument(
        "--store",
        default="./runs",
        help="artifact root (a folder or s3://bucket/prefix) whose _cache/bm25 or _cache/dense holds the index "
        "(default ./runs)",
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
        "--method",
        choices=["bm25", "dense"],
        default="bm25",
        help="how passages are found (task.retrieval_method; default bm25): as the runs' configs say",
    )
    bm25 = parser.add_argument_group("--method bm25 only: as the runs' task.retrieval_* say")
    bm25.add_argument(
        "--stemmer",
        choices=["none", "english"],
        default=None,
        help="stem BM25 terms (task.retrieval_stemmer; default none)",
    )
    bm25.add_argument(
        "--stopwords",
        choices=["none", "english"],
        default=None,
        help="drop these stop words (task.retrieval_stopwords; default english)",
    )
    dense = parser.add_argument_group("--method dense only: as the runs' task.retrieval_* say")
    defaults = DenseEncoding()
    dense.add_argument(
        "--encoder", default=None, help=f"hub id or folder (task.retrieval_encoder; default {defaults.encoder})"
    )
    dense.add_argument(
        "--max-length",
        type=int,
        default=None,
        help=f"tokens read of a query or passage (task.retrieval_max_length; default {defaults.max_length})",
    )
    dense.add_argument(
        "--query-prefix",
        default=None,
        help=f"put before each query (task.retrieval_query_prefix; default {defaults.query_prefix!r})",
    )
    dense.add_argument(
        "--passage-prefix",
        default=None,
        help=f"put before each passage (task.retrieval_passage_prefix; default {defaults.passage_prefix!r})",
    )
    dense.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help=f"passages encoded at once while building (task.retrieval_batch_size; default {defaults.batch_size})",
    )
    dense.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="where the encoder computes: cpu (default), or cuda on a node with a GPU (not yet run on one)",
    )
    parser.add_argument(
        "--build-only",
        action="store_true",
        help="build (or check) the index cache in the store, print the corpus hash, and exit without serving",
    )
    generated = parser.add_argument_group("generated:facts only: the run's data seed and sizes")
    generated.add_argument("--seed", type=int, default=0, help="data.seed, else experiment.seed (default 0)")
    generated.add_argument("--generated-train-size", type=int, default=None, help="data.generated_train_size")
    generated.add_argument("--generated-eval-size", type=int, default=None, help="data.generated_eval_size")
    return parser


BM25_FLAGS = {"stemmer": "--stemmer", "stopwords": "--stopwords"}
DENSE_FLAGS = {
    "encoder": "--encoder",
    "max_length": "--max-length",
    "query_prefix": "--query-prefix",
    "passage_prefix": "--passage-prefix",
    "batch_size": "--batch-size",
}


def _index_method(args: argparse.Namespace) -> IndexMethod:
    """The flags' retrieval method (for dense, its encoder loaded); ValueError naming a flag
    that the method does not read, as the config refuses such a setting."""
    given = {name for name in (*BM25_FLAGS, *DENSE_FLAGS) if getattr(args, name) is not None}
    unread = given & set(DENSE_FLAGS if args.method == "bm25" else BM25_FLAGS)
    if unread:
        flags = ", ".join(sorted({**BM25_FLAGS, **DENSE_FLAGS}[name] for name in unread))
        raise ValueError(f"{flags}: not read by --method {args.method}")
    chosen = {name: getattr(args, name) for name in given}
    if args.method == "bm25":
        return Tokenization(**chosen)
    if chosen.get("max_length", 8) < 8 or chosen.get("batch_size", 1) < 1:
        raise ValueError("--max-length must be at least 8 and --batch-size at least 1")
    return DenseEncoding(**chosen).load(args.device)


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
        method = _index_method(args)
        if args.build_only:
            retriever = cached_retriever(passages, store, method)
            print(
                f"drmas serve-retrieval: {len(retriever.passages)} passages of {args.corpus} indexed "
                f"({method.name}) in {store.root}"
            )
            print(f"corpus hash {corpus_hash(retriever.passages, method)}", flush=True)
            return 0
        server = serve(passages, store, args.host, args.port, method)
        del passages
    except (ValueError, OSError, StoreError) as error:
        print(f"drmas serve-retrieval: {error}", file=sys.stderr)
        return 1
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown, daemon=True).start())
    print(
        f"drmas serve-retrieval: {server.url} serves {len(server.retriever.passages)} passages of {args.corpus} "
        f"({method.name}, corpus hash {server.corpus_hash})",
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
