"""A real S3 API on the loopback interface for tests: moto's server mode in a subprocess.

``S3Server.start()`` picks a free port on 127.0.0.1, starts ``moto.server`` there and waits for
it to answer; ``env()`` gives the variables a batchgen run (or any boto/s3fs client) needs to
reach it. Nothing here mocks batchgen's own code: requests go over HTTP to the server.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field

HOST = "127.0.0.1"
KEY_ID, SECRET = "testing-key", "testing-secret"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


@dataclass
class S3Server:
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self, auth: bool = False) -> S3Server:
        """With ``auth``, the server checks every request's credentials (and knows none)."""
        env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "0"} if auth else None
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", HOST, "-p", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"{self.endpoint}/moto-api/", timeout=1)
                return self
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError("moto server exited at start") from None
                time.sleep(0.1)
        raise RuntimeError("moto server did not answer within 30 s")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None

    def reset(self) -> None:
        """Forget every bucket and object."""
        req = urllib.request.Request(f"{self.endpoint}/moto-api/reset", method="POST")
        urllib.request.urlopen(req, timeout=10)

    def env(self) -> dict[str, str]:
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": KEY_ID, "AWS_SECRET_ACCESS_KEY": SECRET,
                "AWS_DEFAULT_REGION": "us-east-1", "AWS_REGION": "us-east-1"}

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=KEY_ID,
                            aws_secret_access_key=SECRET, region_name="us-east-1")

    def make_bucket(self, name: str) -> str:
        self.client().create_bucket(Bucket=name)
        return name


def apply_env(env: dict[str, str]) -> dict[str, str | None]:
    """Set ``env`` in this process; returns the old values for ``restore_env``."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    return old


def restore_env(old: dict[str, str | None]) -> None:
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


class FlakyProxy:
    """An HTTP proxy on 127.0.0.1 in front of an S3 server that answers every ``every``-th request
    with 503 SlowDown (S3's throttling error) instead of forwarding it: a store under load."""

    def __init__(self, target: str, every: int = 4):
        import http.server
        import threading
        import urllib.error

        proxy = self
        self.target, self.every, self.count, self.throttled = target, every, 0, 0
        self._lock = threading.Lock()

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _any(self) -> None:
                body = self._body()
                with proxy._lock:
                    proxy.count += 1
                    throttle = proxy.count % proxy.every == 0
                    proxy.throttled += throttle
                if throttle:
                    payload = b"<?xml version='1.0'?><Error><Code>SlowDown</Code><Message>Please reduce your " \
                              b"request rate.</Message></Error>"
                    self.send_response(503)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    if self.command != "HEAD":  # a HEAD response has no body, whatever its length says
                        self.wfile.write(payload)
                    return
                headers = {k: v for k, v in self.headers.items()
                           if k.lower() not in ("host", "content-length", "transfer-encoding", "expect")}
                headers.setdefault("Content-Type", "binary/octet-stream")  # else urllib says it is a form
                req = urllib.request.Request(proxy.target + self.path, data=body, headers=headers, method=self.command)
                try:
                    resp = urllib.request.urlopen(req, timeout=60)
                    status, data, out_headers = resp.status, resp.read(), resp.headers.items()
                except urllib.error.HTTPError as e:
                    status, data, out_headers = e.code, e.read(), e.headers.items()
                self.send_response(status)
                length = str(len(data))
                for k, v in out_headers:
                    if k.lower() == "content-length" and self.command == "HEAD":
                        length = v  # the object's size, though no body follows
                    elif k.lower() not in ("content-length", "transfer-encoding", "connection", "server", "date"):
                        self.send_header(k, v)
                self.send_header("Content-Length", length)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            def _body(self) -> bytes | None:
                if "chunked" in (self.headers.get("Transfer-Encoding") or ""):
                    data = b""
                    while size := int(self.rfile.readline().split(b";")[0].strip() or b"0", 16):
                        data += self.rfile.read(size)
                        self.rfile.readline()
                    while self.rfile.readline().strip():  # trailers
                        pass
                    return data
                length = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(length) if length else None

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

        self.server = http.server.ThreadingHTTPServer((HOST, 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://{HOST}:{self.server.server_address[1]}"

    def __enter__(self) -> FlakyProxy:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
