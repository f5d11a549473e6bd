"""A fault-injecting HTTP proxy on 127.0.0.1 in front of the S3 test server: a store that fails in flight.

Each request may meet one fault, scripted (``add``: the next matching requests) or drawn at random (``rate``
of all requests, among ``kinds``):

- ``slowdown``: 503 SlowDown (S3's throttling), before the store sees the request;
- ``error500``: 500 InternalError, before the store sees the request;
- ``lost``: the request reaches the store and it acts, then the connection is closed without a response
  (a create-only PUT so treated succeeded unheard: its retry gets 412 from the store);
- ``cut``: a GET's body is cut halfway (the full Content-Length announced, then the connection closed);
- ``slow``: the response comes ``delay`` seconds late.

The proxy listens on the loopback interface only, forwards only to a loopback target, and shuts itself
down after ``lifetime`` seconds whatever the test does.
"""

from __future__ import annotations

import http.client
import http.server
import random
import re
import threading
from collections import Counter
from dataclasses import dataclass
from urllib.parse import urlsplit

HOST = "127.0.0.1"
KINDS = ("slowdown", "error500", "lost", "cut", "slow")
_ERRORS = {"slowdown": (503, "SlowDown", "Please reduce your request rate."),
           "error500": (500, "InternalError", "We encountered an internal error. Please try again.")}
_DROPPED_HEADERS = ("host", "content-length", "transfer-encoding", "expect", "connection")
_MAX_TRAILERS = 64  # header lines after a chunked body; more is a broken client


@dataclass
class Rule:
    """``times`` faults of ``kind`` for the next requests matching ``method`` and ``key`` (a regex searched in
    the request path); ``create_only``: PUTs carrying ``If-None-Match`` only."""

    kind: str
    method: str | None = None
    key: str | None = None
    create_only: bool = False
    times: int = 1

    def matches(self, method: str, path: str, create_only: bool) -> bool:
        return (self.times > 0 and (self.method is None or self.method == method)
                and (self.key is None or re.search(self.key, path) is not None)
                and (not self.create_only or create_only))


class FaultProxy:
    """``with FaultProxy(server.endpoint, rate=0.12, seed=1) as proxy:`` then point clients at ``proxy.endpoint``.
    ``every``: also a ``slowdown`` on every ``every``-th request. ``faults`` counts the faults made by kind,
    ``statuses`` the store's answers by status code, ``requests`` every request (``hung_up`` those whose
    client went before its body had come whole: not forwarded, as S3 drops them)."""

    def __init__(self, target: str, *, rate: float = 0.0, kinds: tuple[str, ...] = KINDS, seed: int = 0,
                 every: int = 0, delay: float = 0.5, lifetime: float = 900.0):
        if urlsplit(target).hostname not in (HOST, "localhost"):
            raise ValueError(f"FaultProxy forwards to the loopback interface only, not {target}")
        unknown = set(kinds) - set(KINDS)
        if unknown:
            raise ValueError(f"unknown fault kinds {sorted(unknown)}; known: {KINDS}")
        self.target = urlsplit(target)
        self.rate, self.kinds, self.every, self.delay = rate, kinds, every, delay
        self.rules: list[Rule] = []
        self.faults: Counter[str] = Counter()
        self.statuses: Counter[int] = Counter()
        self.kinds_seen: Counter[str] = Counter()  # requests by S3 kind (request_kind): LIST, GET, PUT, ...
        self.lease_requests = 0  # of them, the ones on lease objects (``.locks/``)
        self.requests = 0
        self.hung_up = 0  # requests whose client hung up before its whole body came (not forwarded, not counted)
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.server = http.server.ThreadingHTTPServer((HOST, 0), _handler(self))
        self.server.daemon_threads = True
        self.server.handle_error = lambda request, address: None  # type: ignore[method-assign]  # clients hang up
        self._thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
        self._timer = threading.Timer(lifetime, self.close)
        self._timer.daemon = True

    @property
    def endpoint(self) -> str:
        return f"http://{HOST}:{self.server.server_address[1]}"

    @property
    def throttled(self) -> int:
        return self.faults["slowdown"]

    @property
    def count(self) -> int:
        return self.requests

    def count_hang_up(self) -> None:
        with self._lock:
            self.hung_up += 1

    def add(self, kind: str, method: str | None = None, key: str | None = None, create_only: bool = False,
            times: int = 1) -> FaultProxy:
        if kind not in KINDS:
            raise ValueError(f"unknown fault kind {kind!r}; known: {KINDS}")
        with self._lock:
            self.rules.append(Rule(kind, method, key, create_only, times))
        return self

    def choose(self, method: str, path: str, create_only: bool) -> str | None:
        """The fault for this request, if any (counted)."""
        with self._lock:
            self.requests += 1
            self.kinds_seen[request_kind(method, path)] += 1
            self.lease_requests += "/.locks/" in path
            kind = self._scripted(method, path, create_only) or self._drawn(method)
            if kind:
                self.faults[kind] += 1
            return kind

    def _scripted(self, method: str, path: str, create_only: bool) -> str | None:
        for rule in self.rules:
            if rule.matches(method, path, create_only):
                rule.times -= 1
                return rule.kind
        if self.every and self.requests % self.every == 0:
            return "slowdown"
        return None

    def _drawn(self, method: str) -> str | None:
        if not self.rate or self._rng.random() >= self.rate:
            return None
        kinds = [k for k in self.kinds if k != "cut" or method == "GET"]
        return self._rng.choice(kinds) if kinds else None

    def forward(self, method: str, path: str, headers: dict[str, str], body: bytes | None
                ) -> tuple[int, list[tuple[str, str]], bytes]:
        conn = http.client.HTTPConnection(self.target.hostname, self.target.port, timeout=60)
        try:
            conn.request(method, path, body=body, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
            with self._lock:
                self.statuses[resp.status] += 1
            return resp.status, resp.getheaders(), data
        finally:
            conn.close()

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._timer.cancel()
        if self._thread.is_alive():
            self.server.shutdown()
        self.server.server_close()


def request_kind(method: str, path: str) -> str:
    """What S3 bills a request as: LIST (a GET of a bucket, path style), else its method."""
    url = urlsplit(path)
    bucket_and_key = url.path.lstrip("/").split("/", 1)
    if method == "GET" and (len(bucket_and_key) < 2 or not bucket_and_key[1] or "list-type" in url.query):
        return "LIST"
    return method


def _handler(proxy: FaultProxy) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def _any(self) -> None:
            try:
                body = _request_body(self)
            except ClientGone:  # S3 drops a request whose body never arrived whole
                proxy.count_hang_up()
                self.close_connection = True
                return None
            create_only = self.command == "PUT" and "If-None-Match" in self.headers
            kind = proxy.choose(self.command, self.path, create_only)
            if kind in _ERRORS:
                return self._error(*_ERRORS[kind])
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _DROPPED_HEADERS}
            if kind == "slow":
                threading.Event().wait(proxy.delay)
            status, out_headers, data = proxy.forward(self.command, self.path, headers, body)
            if kind == "lost":
                self.close_connection = True  # the store acted; its answer never arrives
                return None
            self._answer(status, out_headers, data, cut=kind == "cut")
            return None

        def _error(self, status: int, code: str, message: str) -> None:
            payload = f"<?xml version='1.0'?><Error><Code>{code}</Code><Message>{message}</Message></Error>".encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            if self.command != "HEAD":  # a HEAD response has no body, whatever its length says
                self.wfile.write(payload)

        def _answer(self, status: int, out_headers: list[tuple[str, str]], data: bytes, cut: bool) -> None:
            self.send_response(status)
            length = str(len(data))
            for k, v in out_headers:
                if k.lower() == "content-length" and self.command == "HEAD":
                    length = v  # the object's size, though no body follows
                elif k.lower() not in ("content-length", "transfer-encoding", "connection", "server", "date"):
                    self.send_header(k, v)
            self.send_header("Content-Length", length)
            self.end_headers()
            if self.command == "HEAD":
                return
            if cut and len(data) > 1:
                self.wfile.write(data[: len(data) // 2])
                self.close_connection = True
                return
            self.wfile.write(data)

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

    return Handler


class ClientGone(Exception):
    """The connection ended before the request's whole body came (a writer killed mid-PUT): forwarded, the part
    would become a short object, which S3 never stores."""


def _request_body(handler: http.server.BaseHTTPRequestHandler) -> bytes | None:
    """The request's body, de-chunked (the forwarded request carries a plain Content-Length); ClientGone when it
    does not come whole."""
    if "chunked" not in (handler.headers.get("Transfer-Encoding") or ""):
        length = int(handler.headers.get("Content-Length") or 0)
        if not length:
            return None
        data = handler.rfile.read(length)
        if len(data) < length:
            raise ClientGone
        return data
    data = b""
    while True:
        line = handler.rfile.readline()
        if not line:
            raise ClientGone
        size = int(line.split(b";")[0].strip() or b"0", 16)
        if not size:
            break
        chunk = handler.rfile.read(size)
        if len(chunk) < size:
            raise ClientGone
        data += chunk
        handler.rfile.readline()
    for _ in range(_MAX_TRAILERS):
        if not handler.rfile.readline().strip():
            break
    return data
