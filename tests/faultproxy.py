"""A fault-injecting HTTP/1.1 proxy for the store tests, in front of the real S3 server.

It listens on 127.0.0.1, passes each request's bytes to the upstream server unchanged (so
the client's SigV4 signature, made for the proxy's host:port, is what the server checks),
and, on a seeded random fraction of requests, misbehaves instead, as an object store under
load or a flaky network does:

    error500      reply 500 InternalError (S3's XML body), request not applied
    error503      reply 503 SlowDown (S3's XML body), request not applied
    drop_request  close the connection without forwarding or replying
    drop_reply    forward (the request IS applied), then close without replying
    stall         hold the connection, silent, for ``stall_s``, then close; not applied
    cut_reply     forward, send the reply's head and half its body, then close
    stall_reply   forward, send the reply's head and half its body, then stall

    with FaultProxy(s3_server.endpoint, {"error503": 0.2, "drop_reply": 0.1}, seed=1) as proxy:
        store = Store("s3://bucket/prefix", proxy.endpoint)
        ...
        proxy.injected  # Counter: fault -> how many times it was injected
        proxy.set_faults({"error503": 1.0})  # the store stays down
        proxy.stop()    # and now refuses connections

Only what the tests need of HTTP/1.1: requests with Content-Length or chunked bodies and
``Expect: 100-continue``; replies with Content-Length, chunked or read-to-close bodies.
"""

from __future__ import annotations

import random
import socket
import socketserver
import threading
from collections import Counter
from collections.abc import Mapping
from typing import BinaryIO

__all__ = ["FAULTS", "FaultProxy"]

FAULTS = ("error500", "error503", "drop_request", "drop_reply", "stall", "cut_reply", "stall_reply")
S3_ERRORS = {
    "error500": (500, "Internal Server Error", "InternalError", "We encountered an internal error. Please try again."),
    "error503": (503, "Slow Down", "SlowDown", "Please reduce your request rate."),
}


class FaultProxy:
    """A threaded proxy to ``upstream`` (http://host:port) that injects ``faults``: a
    fault name -> the fraction of requests that get it (fractions add up to at most 1)."""

    def __init__(
        self, upstream: str, faults: Mapping[str, float] | None = None, seed: int = 0, stall_s: float = 60.0
    ) -> None:
        host, _, port = upstream.removeprefix("http://").rstrip("/").partition(":")
        self.upstream = (host, int(port or 80))
        self.stall_s = stall_s
        self.requests = 0
        self.injected: Counter[str] = Counter()
        self._random = random.Random(seed)
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._clients: set[socket.socket] = set()
        self._faults: dict[str, float] = {}
        self.set_faults(faults or {})
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.proxy = self
        self._thread: threading.Thread | None = None

    @property
    def endpoint(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def set_faults(self, faults: Mapping[str, float]) -> None:
        unknown = set(faults) - set(FAULTS)
        if unknown or sum(faults.values()) > 1 or any(share < 0 for share in faults.values()):
            raise ValueError(f"faults must be among {FAULTS} with fractions adding up to at most 1: {dict(faults)}")
        with self._lock:
            self._faults = dict(faults)

    def start(self) -> FaultProxy:
        self._thread = threading.Thread(target=self._server.serve_forever, name="fault-proxy", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop listening (new connections are refused), wake every stall and cut every open
        connection, so that a client's pooled keep-alive connection cannot get through."""
        self._stopping.set()
        self._server.shutdown()
        self._server.server_close()
        with self._lock:
            clients = list(self._clients)
        for client in clients:
            _close(client)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ----------------------------------------------------------------------------------

    def _draw(self) -> str | None:
        """Count the request and decide its fate: a fault name, or None to pass it on."""
        with self._lock:
            self.requests += 1
            draw = self._random.random()
            for fault, share in self._faults.items():
                if draw < share:
                    self.injected[fault] += 1
                    return fault
                draw -= share
        return None

    def _register(self, client: socket.socket, is_open: bool) -> None:
        """Track open client connections, for ``stop`` to cut."""
        with self._lock:
            if is_open:
                self._clients.add(client)
            else:
                self._clients.discard(client)

    def _stall(self) -> None:
        self._stopping.wait(self.stall_s)

    def _forward(self, request: bytes, method: str) -> tuple[bytes, bytes, bool]:
        """Send the request upstream on a fresh connection; its reply's head, body, and
        whether the reply ends by closing the connection."""
        with socket.create_connection(self.upstream, timeout=120) as upstream:
            upstream.sendall(request)
            reader = upstream.makefile("rb")
            while True:
                head = _read_head(reader)
                status = int(head.split(b" ", 2)[1])
                if not 100 <= status < 200:  # skip interim replies (100 Continue)
                    break
            headers = _headers(head)
            if method == "HEAD" or status in (204, 304):
                return head, b"", False
            if "content-length" in headers or "chunked" in headers.get("transfer-encoding", ""):
                return head, _read_body(reader, headers), headers.get("connection", "").lower() == "close"
            return head, reader.read(), True


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    proxy: FaultProxy


class _Handler(socketserver.StreamRequestHandler):
    """One client connection: requests in turn (keep-alive), each forwarded or faulted."""

    server: _Server

    def handle(self) -> None:
        proxy = self.server.proxy
        proxy._register(self.connection, True)
        try:
            while not proxy._stopping.is_set() and self._serve_one(proxy):
                pass
        except (OSError, ValueError):
            pass  # the client (or the proxy's stop) closed the connection
        finally:
            proxy._register(self.connection, False)

    def _serve_one(self, proxy: FaultProxy) -> bool:
        """Serve one request; whether the connection stays open for the next one."""
        head = _read_head(self.rfile)
        if not head:
            return False
        method = head.split(b" ", 1)[0].decode()
        headers = _headers(head)
        if headers.get("expect", "").lower() == "100-continue":
            self.wfile.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request = head + _read_body(self.rfile, headers)
        fault = proxy._draw()
        if fault in S3_ERRORS:
            self.wfile.write(_s3_error(*S3_ERRORS[fault]))
            return True
        if fault == "drop_request":
            return False
        if fault == "stall":
            proxy._stall()
            return False
        reply_head, body, closes = proxy._forward(request, method)
        if fault == "drop_reply":
            return False
        if fault in ("cut_reply", "stall_reply"):
            self.wfile.write(reply_head + body[: len(body) // 2])
            self.wfile.flush()
            if fault == "stall_reply":
                proxy._stall()
            return False
        self.wfile.write(reply_head + body)
        return not closes and headers.get("connection", "").lower() != "close"


def _read_head(reader: BinaryIO) -> bytes:
    """The request or status line and headers, up to and including the blank line; b"" at
    the end of the stream."""
    lines = []
    while True:
        line = reader.readline(65537)
        if not line:
            if lines:
                raise ValueError("connection closed inside an HTTP head")
            return b""
        lines.append(line)
        if line in (b"\r\n", b"\n"):
            return b"".join(lines)


def _headers(head: bytes) -> dict[str, str]:
    fields = {}
    for line in head.decode("latin-1").split("\r\n")[1:]:
        name, sep, value = line.partition(":")
        if sep:
            fields[name.strip().lower()] = value.strip()
    return fields


def _read_body(reader: BinaryIO, headers: dict[str, str]) -> bytes:
    """The message body as it was sent (chunk framing kept), by Content-Length or chunks."""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        parts = []
        while True:
            size_line = reader.readline(65537)
            parts.append(size_line)
            size = int(size_line.split(b";", 1)[0].strip() or b"0", 16)
            if size == 0:
                parts.append(_read_head(reader) or b"")  # trailers, then the blank line
                return b"".join(parts)
            parts.append(_read_exactly(reader, size + 2))
    return _read_exactly(reader, int(headers.get("content-length", "0")))


def _read_exactly(reader: BinaryIO, size: int) -> bytes:
    data = reader.read(size)
    if len(data) != size:
        raise ValueError(f"connection closed after {len(data)} of {size} body bytes")
    return data


def _s3_error(status: int, reason: str, code: str, message: str) -> bytes:
    body = (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{code}</Code><Message>{message}</Message><RequestId>fault-proxy</RequestId></Error>"
    ).encode()
    head = f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\nContent-Length: {len(body)}\r\n\r\n"
    return head.encode() + body


def _close(connection: socket.socket) -> None:
    try:
        connection.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already closed by its handler
    connection.close()
