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


def FlakyProxy(target: str, every: int = 4):  # noqa: N802 (was a class; s3_faults.FaultProxy now)
    """A store under load: every ``every``-th request answered 503 SlowDown (``s3_faults.FaultProxy``)."""
    from s3_faults import FaultProxy

    return FaultProxy(target, every=every)
