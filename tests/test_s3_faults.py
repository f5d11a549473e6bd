"""The fault-injecting proxy itself (tests/s3_faults.py): each fault kind does what it says, seen by a
boto3 client that does not retry, and the store behind it acts (or not) as the kind says."""

from __future__ import annotations

import time

import pytest
from s3_faults import FaultProxy
from s3_server import KEY_ID, SECRET


def raw_client(endpoint: str):
    """A client that reports every failure at once (no retries of its own)."""
    import boto3
    from botocore.config import Config

    return boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=KEY_ID, aws_secret_access_key=SECRET,
                        region_name="us-east-1",
                        config=Config(retries={"total_max_attempts": 1, "mode": "standard"}, read_timeout=10))


@pytest.fixture
def name(bucket):
    return bucket.removeprefix("s3://")


@pytest.mark.parametrize("kind,status,code", [("slowdown", 503, "SlowDown"), ("error500", 500, "InternalError")])
def test_errors_come_before_the_store_acts(s3_server, name, kind, status, code):
    with FaultProxy(s3_server.endpoint) as proxy:
        proxy.add(kind, method="PUT")
        client = raw_client(proxy.endpoint)
        with pytest.raises(client.exceptions.ClientError) as e:
            client.put_object(Bucket=name, Key="k", Body=b"x")
        assert e.value.response["ResponseMetadata"]["HTTPStatusCode"] == status
        assert e.value.response["Error"]["Code"] == code
        assert proxy.faults == {kind: 1}
    assert "Contents" not in s3_server.client().list_objects_v2(Bucket=name)  # never reached the store


def test_a_lost_create_only_put_acted_and_its_retry_gets_412(s3_server, name):
    from botocore.exceptions import ConnectionClosedError, EndpointConnectionError

    with FaultProxy(s3_server.endpoint) as proxy:
        proxy.add("lost", method="PUT", create_only=True)
        client = raw_client(proxy.endpoint)
        with pytest.raises((ConnectionClosedError, EndpointConnectionError)):
            client.put_object(Bucket=name, Key="part", Body=b"mine", IfNoneMatch="*")
        assert s3_server.client().get_object(Bucket=name, Key="part")["Body"].read() == b"mine"  # it acted
        with pytest.raises(client.exceptions.ClientError) as again:
            client.put_object(Bucket=name, Key="part", Body=b"mine", IfNoneMatch="*")
        assert again.value.response["Error"]["Code"] == "PreconditionFailed"
        assert proxy.statuses[412] == 1


def test_a_cut_body_and_a_slow_answer(s3_server, name):
    s3_server.client().put_object(Bucket=name, Key="obj", Body=b"y" * 10_000)
    with FaultProxy(s3_server.endpoint, delay=0.3) as proxy:
        proxy.add("cut", method="GET").add("slow", method="GET")
        client = raw_client(proxy.endpoint)
        with pytest.raises(Exception) as e:
            client.get_object(Bucket=name, Key="obj")["Body"].read()
        assert "IncompleteRead" in type(e.value).__name__ + repr(e.value) or "ResponseStreamingError" in \
            type(e.value).__name__, repr(e.value)
        start = time.monotonic()
        assert client.get_object(Bucket=name, Key="obj")["Body"].read() == b"y" * 10_000
        assert time.monotonic() - start >= 0.3
        assert proxy.faults == {"cut": 1, "slow": 1}


def test_random_faults_at_a_rate_and_the_loopback_only_rule(s3_server, name):
    with FaultProxy(s3_server.endpoint, rate=0.5, kinds=("slowdown",), seed=3) as proxy:
        client = raw_client(proxy.endpoint)
        failed = 0
        for i in range(40):
            try:
                client.put_object(Bucket=name, Key=f"k{i}", Body=b"z")
            except client.exceptions.ClientError:
                failed += 1
        assert failed == proxy.faults["slowdown"] and 8 <= failed <= 32 and proxy.requests == 40
    with pytest.raises(ValueError, match="loopback"):
        FaultProxy("http://example.com:80")


def test_the_proxy_stops_by_itself(s3_server):
    proxy = FaultProxy(s3_server.endpoint, lifetime=0.2).__enter__()
    time.sleep(0.6)
    assert not proxy._thread.is_alive()


@pytest.mark.parametrize("chunked", [False, True], ids=["length", "chunked"])
def test_a_put_whose_writer_dies_mid_body_stores_nothing(s3_server, name, chunked):
    """A writer killed while sending a PUT's body: S3 drops the request, so the proxy must not forward what
    came (moto would store it as a short object, which a killed run never leaves on a real bucket)."""
    import socket
    from urllib.parse import urlsplit

    with FaultProxy(s3_server.endpoint) as proxy:
        target = urlsplit(proxy.endpoint)
        framing = "Transfer-Encoding: chunked" if chunked else "Content-Length: 1000"
        head = f"PUT /{name}/part-1 HTTP/1.1\r\nHost: {target.netloc}\r\n{framing}\r\n\r\n".encode()
        body = b"3e8\r\n" + b"x" * 100 if chunked else b"x" * 100  # a tenth of the body, then the hang-up
        with socket.create_connection((target.hostname, target.port)) as sock:
            sock.sendall(head + body)
        deadline = time.monotonic() + 5
        while proxy.hung_up == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert proxy.hung_up == 1 and proxy.requests == 0
    assert "Contents" not in s3_server.client().list_objects_v2(Bucket=name)
