"""The per-store differences, behind one small interface: local (and NFS) directories, and
object stores reached through fsspec (``s3://`` with s3fs, ``gs://`` with gcsfs).

What differs is how a file becomes visible whole: locally a temp file in the same directory,
fsynced, then renamed (or hard-linked, which refuses an existing name); on a bucket one PUT of
the finished object, which the store shows whole or not at all, made create-only with a
conditional write (S3 ``If-None-Match: *``, GCS ``ifGenerationMatch=0``) where asked.
"""

from __future__ import annotations

import base64
import errno
import glob as globlib
import hashlib
import io
import logging
import os
import random
import re
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from functools import wraps
from pathlib import Path
from typing import IO, Any

from ..extras import install_hint
from .options import StorageOptions
from .scratch import scratch_file

logger = logging.getLogger("batchgen.storage")

# The pip extra that brings each protocol's library.
EXTRAS = {"s3": ("s3fs", "s3"), "s3a": ("s3fs", "s3"), "gs": ("gcsfs", "gcs"), "gcs": ("gcsfs", "gcs")}
READ_BLOCK = 8 << 20  # bytes fetched per request when streaming an object
LINE_BUFFER = 1 << 20
CONTENT_MD5 = "batchgen-md5"  # an uploaded object's metadata key: its content's MD5, hex


class StorageError(OSError):
    """A storage problem the user can act on, as one line naming the URL and the cause."""


@dataclass(frozen=True)
class FileInfo:
    size: int
    mtime: float  # seconds since the epoch
    etag: str | None = None


Writer = Callable[[Path], object]  # writes a whole file at the given local path


class Store(ABC):
    scheme = ""

    def url(self, path: str) -> str:
        return f"{self.scheme}://{path}" if self.scheme else path

    @property
    def is_local(self) -> bool:
        return not self.scheme

    @abstractmethod
    def exists(self, path: str) -> bool: ...

    @abstractmethod
    def is_dir(self, path: str) -> bool: ...

    @abstractmethod
    def is_file(self, path: str) -> bool: ...

    @abstractmethod
    def info(self, path: str) -> FileInfo: ...

    @abstractmethod
    def list_files(self, path: str) -> dict[str, FileInfo]:
        """The files directly in a directory (or under a key prefix ending in ``/``): path -> info."""

    @abstractmethod
    def glob(self, pattern: str) -> list[str]:
        """Files matching a glob (``**`` crosses directories), sorted."""

    def walk_files(self, path: str) -> dict[str, FileInfo]:
        """Every file under a directory (key prefix), at any depth: path -> info; a file: itself.
        Stores override this with one listing; this fallback asks for each file's info."""
        if self.is_file(path):
            return {path: self.info(path)}
        return {p: self.info(p) for p in self.glob(path.rstrip("/") + "/**")}

    @abstractmethod
    def open_read(self, path: str) -> IO[bytes]:
        """A seekable binary stream that fetches as it reads, never the whole object first."""

    @abstractmethod
    def publish(self, path: str, write: Writer, create_only: bool = False) -> bool:
        """``write`` a whole file and make it visible at ``path`` at once. With ``create_only``,
        refuse (return False) if ``path`` exists, atomically: of two writers only one wins."""

    @abstractmethod
    def remove(self, path: str, missing_ok: bool = True) -> None: ...

    @abstractmethod
    def prepare_dir(self, path: str) -> None:
        """Make the directory exist (locally), or check that its bucket exists and answers."""


# -------------------------------------------------------------------------------------- local


class LocalStore(Store):
    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def is_dir(self, path: str) -> bool:
        return os.path.isdir(path)

    def is_file(self, path: str) -> bool:
        return os.path.isfile(path)

    def info(self, path: str) -> FileInfo:
        st = os.stat(path)
        return FileInfo(st.st_size, st.st_mtime)

    def list_files(self, path: str) -> dict[str, FileInfo]:
        out = {}
        try:
            entries = list(os.scandir(path))
        except FileNotFoundError:
            return {}
        for e in entries:
            if e.is_file():
                st = e.stat()
                out[e.path] = FileInfo(st.st_size, st.st_mtime)
        return out

    def glob(self, pattern: str) -> list[str]:
        return sorted(p for p in globlib.glob(pattern, recursive=True) if os.path.isfile(p))

    def walk_files(self, path: str) -> dict[str, FileInfo]:
        if os.path.isfile(path):
            return {path: self.info(path)}
        out = {}
        for root, _dirs, files in os.walk(path):
            for name in files:
                full = os.path.join(root, name)
                out[full] = self.info(full)
        return out

    def open_read(self, path: str) -> IO[bytes]:
        return open(path, "rb")  # noqa: SIM115

    def publish(self, path: str, write: Writer, create_only: bool = False) -> bool:
        final = Path(path)
        tmp = final.with_name(f".{final.name.lstrip('.')}.{os.getpid()}.tmp")
        try:
            write(tmp)
            _fsync(tmp)
            if create_only:
                try:
                    os.link(tmp, final)  # refuses an existing name, atomically
                except FileExistsError:
                    return False
                except OSError as e:  # a filesystem without hard links: the shard lock still serialises
                    if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
                        raise
                    if final.exists():
                        return False
                    os.replace(tmp, final)
            else:
                os.replace(tmp, final)
            _fsync(final.parent)
            return True
        finally:
            tmp.unlink(missing_ok=True)

    def remove(self, path: str, missing_ok: bool = True) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            if not missing_ok:
                raise
            return
        _fsync(Path(path).parent)

    def prepare_dir(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------------- fsspec


def _mapped(method: Callable[..., Any]) -> Callable[..., Any]:
    """One call to the store, retried while its failure is transient (``Retries``), and a cloud library's
    exception turned into a ``StorageError`` naming the URL and the cause, leaving the ones callers act on
    (not found, exists) as they are."""

    @wraps(method)
    def call(self: FsspecStore, path: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return self.retries.run(lambda: method(self, path, *args, **kwargs), self.url(path))
        except (FileNotFoundError, FileExistsError, StorageError):
            raise
        except Exception as e:
            tries = f" (still failing after {self.retries.attempts_for(e)} attempts)" if is_transient(e) else ""
            raise StorageError(f"{self.url(path)}: {describe(e)}{tries}") from None

    return call


def describe(e: BaseException) -> str:
    """One line for a cloud library's error: what went wrong, and what to check. Connection
    failures are told first: their text holds a URL, whose port may contain anything."""
    name = type(e).__name__
    text = str(e).strip().splitlines()[0] if str(e).strip() else name
    if name in ("EndpointConnectionError", "ConnectTimeoutError", "ClientConnectorError") or \
            "Could not connect" in text or "Connect timeout" in text:
        return f"cannot reach the storage endpoint ({text}); check AWS_ENDPOINT_URL or storage.endpoint_url"
    if name in ("NoCredentialsError", "PartialCredentialsError"):
        return "no credentials found; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE, " \
               "or storage.anonymous: true for a public bucket"
    if "InvalidAccessKeyId" in text or "SignatureDoesNotMatch" in text:
        return f"the credentials were refused ({text})"
    if isinstance(e, PermissionError) or "AccessDenied" in text or "Forbidden" in text:
        return f"access denied ({text}); check the credentials (AWS_ACCESS_KEY_ID / AWS_PROFILE, " \
               "GOOGLE_APPLICATION_CREDENTIALS) and the bucket's policy"
    return f"{name}: {text}"


@dataclass(frozen=True)
class Retries:
    """Bounded exponential backoff with full jitter: ``attempts`` tries in all, the wait before retry i
    drawn from [0, min(max_wait, first_wait * 2**i)]. Only a transient failure is retried."""

    attempts: int = 8
    first_wait: float = 0.2
    max_wait: float = 20.0

    @classmethod
    def of(cls, options: StorageOptions) -> Retries:
        return cls(options.retries, options.retry_wait, options.retry_max_wait)

    def wait(self, retry: int) -> float:
        return random.uniform(0.0, min(self.max_wait, self.first_wait * 2 ** retry))

    def run(self, call: Callable[[], Any], url: str | None = None) -> Any:
        """``call``'s result, retrying it while it fails transiently. A refused connection (nothing listens at
        the endpoint) is tried at most REFUSED_ATTEMPTS times; every retry of a failure to connect is told in a
        line (logger ``batchgen.storage``), so an unreachable store never looks like a hang."""
        for retry in range(self.attempts):
            try:
                return call()
            except Exception as e:
                attempts = self.attempts_for(e)
                if retry + 1 >= attempts or not is_transient(e):
                    raise
                pause = self.wait(retry)
                if not_connected(e):
                    logger.warning("%s: cannot reach the storage endpoint%s: retrying (attempt %d of %d, next in "
                                   "%.1fs)", url or "store", _endpoint(e), retry + 2, attempts, pause)
            time.sleep(pause)
        raise AssertionError("unreachable: the last attempt returns or raises")

    def attempts_for(self, e: BaseException) -> int:
        """How many tries a failure like ``e`` gets in all: fewer for a refused connection, which more waiting
        seldom mends (a wrong endpoint or port), than for throttling or a dropped connection."""
        return min(self.attempts, REFUSED_ATTEMPTS) if is_refused(e) else self.attempts


REFUSED_ATTEMPTS = 3  # a refused connection: two quick retries (a server restarting), then the one line


def not_connected(e: BaseException) -> bool:
    """The call never reached the store: the connection failed or was refused (not a throttle, not a 5xx)."""
    return any(type(err).__name__ in _CONNECT_NAMES or isinstance(err, ConnectionRefusedError)
               or "Could not connect" in str(err) for err in _chain(e))


def is_refused(e: BaseException) -> bool:
    """Nothing listens at the endpoint: the connection was refused (ECONNREFUSED)."""
    return any(isinstance(err, ConnectionRefusedError) or getattr(err, "errno", None) == errno.ECONNREFUSED
               or "Connection refused" in str(err) or "Connect call failed" in str(err) for err in _chain(e))


def _endpoint(e: BaseException) -> str:
    """` (http://host:port, connection refused)` from the failure's text, as far as it says."""
    found = re.search(r"https?://[^/\"'\s]+", " ".join(str(err) for err in _chain(e)))
    parts = ([found.group(0)] if found else []) + (["connection refused"] if is_refused(e) else [])
    return f" ({', '.join(parts)})" if parts else ""


_CONNECT_NAMES = frozenset({"EndpointConnectionError", "ConnectTimeoutError", "ClientConnectorError",
                            "NewConnectionError", "ConnectError"})


# Errors that say nothing about the request itself: the store or the way to it failed for a moment.
_TRANSIENT_NAMES = frozenset({
    "ConnectionClosedError", "ReadTimeoutError", "ConnectTimeoutError", "EndpointConnectionError",
    "ResponseStreamingError", "IncompleteReadError", "IncompleteRead", "ProtocolError", "ClientPayloadError",
    "ServerDisconnectedError", "ClientOSError", "ServerTimeoutError", "ClientConnectorError", "FSTimeoutError",
    "ResponseParserError", "TransferEncodingError", "ContentLengthError",
})
_TRANSIENT_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequests",
    "RequestTimeout", "InternalError", "ServiceUnavailable", "BadGateway", "GatewayTimeout",
})
_PERMANENT = (FileNotFoundError, FileExistsError, PermissionError, NotADirectoryError, IsADirectoryError)


def is_transient(e: BaseException) -> bool:
    """Whether a store call that raised ``e`` may succeed if tried again: a 5xx or throttling answer, a
    connection reset or timeout, a body cut short. A refusal (403, no such bucket, bad credentials), a
    missing object and a failed condition are not."""
    for err in _chain(e):
        if isinstance(err, _PERMANENT):
            return False
        status, code = _http_status(err)
        if status is not None:
            return status >= 500 or status == 429 or code in _TRANSIENT_CODES
        if type(err).__name__ in _TRANSIENT_NAMES or isinstance(err, (ConnectionError, TimeoutError)):
            return True
    return "reduce your request rate" in str(e) or "SlowDown" in str(e)


def _chain(e: BaseException) -> list[BaseException]:
    """``e`` and the exceptions it was raised from, outermost first (bounded: a cycle ends it)."""
    out: list[BaseException] = []
    err: BaseException | None = e
    while err is not None and err not in out and len(out) < 16:
        out.append(err)
        err = err.__cause__ or (None if err.__suppress_context__ else err.__context__)
    return out


def _http_status(err: BaseException) -> tuple[int | None, str | None]:
    """The HTTP status and error code of a botocore ``ClientError`` or a gcsfs ``HttpError``."""
    response = getattr(err, "response", None)
    if isinstance(response, dict) and "Error" in response:
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return (int(status) if status else None), response["Error"].get("Code")
    code = getattr(err, "code", None)
    if type(err).__name__ == "HttpError" and isinstance(code, int):
        return code, None
    return None, None


class FsspecStore(Store):
    """An object store through fsspec. Paths are ``bucket/key``; directories are key prefixes."""

    def __init__(self, protocol: str, options: StorageOptions):
        lib, extra = EXTRAS.get(protocol, (protocol, protocol))
        try:
            import fsspec

            kwargs = {**_retry_kwargs(protocol), **options.fsspec_kwargs(protocol)}
            self.fs = fsspec.filesystem(protocol, skip_instance_cache=True, **kwargs)
        except ImportError:
            raise StorageError(f"{protocol}:// paths need {lib}: {install_hint(extra, lib)}") from None
        except ValueError as e:
            raise StorageError(f"{protocol}://: {e}") from None
        if protocol in ("s3", "s3a"):
            self.fs.retries = 1  # s3fs's own loop: the retries are ``self.retries``, around each call
        self.scheme = protocol
        self.options = options
        self.retries = Retries.of(options)

    def _fresh(self, path: str) -> None:
        self.fs.invalidate_cache(path)

    # fsspec's exists/isdir/isfile answer False for any error, a throttled request's included: these ask
    # info, whose transient errors are retried, and read "not there" from FileNotFoundError alone.
    @_mapped
    def exists(self, path: str) -> bool:
        return self._kind(path) is not None

    @_mapped
    def is_dir(self, path: str) -> bool:
        return self._kind(path) == "directory"

    @_mapped
    def is_file(self, path: str) -> bool:
        return self._kind(path) == "file"

    def _kind(self, path: str) -> str | None:
        """"file", "directory", or None where nothing is there."""
        self._fresh(path)
        try:
            return str(self.fs.info(path).get("type"))
        except FileNotFoundError:
            return None

    @_mapped
    def info(self, path: str) -> FileInfo:
        self._fresh(path)
        return _file_info(self.fs.info(path))

    @_mapped
    def list_files(self, path: str) -> dict[str, FileInfo]:
        self._fresh(path)
        try:
            entries = self.fs.ls(path.rstrip("/"), detail=True, refresh=True)
        except FileNotFoundError:
            if "/" not in path.strip("/"):
                raise
            return {}
        return {e["name"]: _file_info(e) for e in entries if e.get("type") == "file"}

    @_mapped
    def glob(self, pattern: str) -> list[str]:
        self._fresh(pattern.split("*", 1)[0])
        found = self.fs.glob(pattern, detail=True)
        return sorted(p for p, e in found.items() if e.get("type") == "file")

    @_mapped
    def walk_files(self, path: str) -> dict[str, FileInfo]:
        self._fresh(path)
        found = self.fs.find(path.rstrip("/"), detail=True)
        # A key ending in "/" is a folder marker (the S3 console's "Create folder"), not a file.
        return {p: _file_info(e) for p, e in sorted(found.items()) if e.get("type") == "file" and not p.endswith("/")}

    @_mapped
    def open_read(self, path: str) -> IO[bytes]:
        # fsspec's own readline reads a whole block per line; a BufferedReader finds lines in its
        # buffer and asks the object for the next megabyte only when it runs dry.
        raw = self.fs.open(path, "rb", block_size=READ_BLOCK, cache_type="readahead")
        return io.BufferedReader(_RetriedReads(raw, self.retries, self.url(path)), buffer_size=LINE_BUFFER)

    def publish(self, path: str, write: Writer, create_only: bool = False) -> bool:
        tmp = scratch_file("upload", suffix=".upload")
        try:
            try:
                write(tmp)
            except StorageError:
                raise
            except OSError as e:
                raise StorageError(f"{self.url(path)}: cannot build it in {tmp.parent}: {e.strerror or e}") from None
            return self._upload(path, tmp, _md5(tmp), create_only)
        finally:
            tmp.unlink(missing_ok=True)

    @_mapped
    def _upload(self, path: str, tmp: Path, digest: Any, create_only: bool) -> bool:
        """One PUT of ``tmp`` (retried as one call); a create-only PUT refused for an object holding these
        very bytes (its own first attempt, whose answer was lost) counts as done."""
        try:
            self.fs.put_file(str(tmp), path, mode="create" if create_only else "overwrite",
                             **self._content_tag(digest.hexdigest()))
        except FileExistsError:
            return self._is_ours(path, tmp, digest)
        self._fresh(path)
        return True

    def _content_tag(self, md5: str) -> dict[str, Any]:
        """The object's metadata naming its content's MD5 (S3: a multipart upload's ETag is not one)."""
        return {"Metadata": {CONTENT_MD5: md5}} if self.scheme in ("s3", "s3a") else {}

    def _is_ours(self, path: str, tmp: Path, digest: Any) -> bool:
        """Whether the object a create-only PUT was refused for holds exactly our bytes: a retried
        PUT (after a lost response or a throttled reply) is refused by the object its own first
        attempt created. A single PUT's ETag is the MD5 of its content (hex on S3, base64 in GCS's
        md5Hash); on S3 the object's metadata names it too, multipart or not."""
        self._fresh(path)
        info = _file_info(self.fs.info(path))
        if info.size != tmp.stat().st_size:
            return False
        if info.etag in (digest.hexdigest(), base64.b64encode(digest.digest()).decode()):
            return True
        return bool(self._content_tag("")) and self.fs.metadata(path).get(CONTENT_MD5) == digest.hexdigest()

    @_mapped
    def remove(self, path: str, missing_ok: bool = True) -> None:
        try:
            self.fs.rm_file(path)
        except FileNotFoundError:
            if not missing_ok:
                raise
        self._fresh(path)

    @_mapped
    def prepare_dir(self, path: str) -> None:
        bucket = path.split("/", 1)[0]
        try:
            self.fs.ls(bucket, refresh=True)
        except FileNotFoundError:
            raise StorageError(f"{self.url(bucket)}: no such bucket (batchgen does not create buckets)") from None


class _RetriedReads(io.RawIOBase):
    """A bucket object's stream whose every read is one retried call: a body cut short or a reset
    connection is read again from the same offset."""

    def __init__(self, raw: Any, retries: Retries, url: str):
        self.raw, self.retries, self.url = raw, retries, url

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.raw.seek(offset, whence)

    def tell(self) -> int:
        return self.raw.tell()

    def readinto(self, buffer: Any) -> int:
        at = self.raw.tell()

        def once() -> bytes:
            self.raw.seek(at)
            return self.raw.read(len(buffer))

        try:
            data = self.retries.run(once, self.url)
        except Exception as e:
            raise StorageError(f"{self.url}: {describe(e)}") from None
        buffer[: len(data)] = data
        return len(data)

    def close(self) -> None:
        self.raw.close()
        super().close()


def _file_info(entry: dict[str, Any]) -> FileInfo:
    mtime = entry.get("LastModified") or entry.get("mtime") or entry.get("updated") or 0
    if hasattr(mtime, "timestamp"):
        mtime = mtime.timestamp()
    elif isinstance(mtime, str):
        from datetime import datetime

        mtime = datetime.fromisoformat(mtime.replace("Z", "+00:00")).timestamp()
    etag = entry.get("ETag") or entry.get("etag") or entry.get("md5Hash")
    return FileInfo(int(entry.get("size") or 0), float(mtime), etag.strip('"') if isinstance(etag, str) else None)


def _retry_kwargs(protocol: str) -> dict[str, Any]:
    """botocore tries each request once: ``Retries`` retries the whole call (one loop, one backoff)."""
    if protocol not in ("s3", "s3a"):
        return {}
    return {"config_kwargs": {"retries": {"total_max_attempts": 1, "mode": "standard"},
                              "connect_timeout": 10, "read_timeout": 60}}


def _md5(path: Path) -> hashlib._Hash:
    digest = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest
