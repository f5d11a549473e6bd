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
import os
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from functools import wraps
from pathlib import Path
from typing import IO, Any

from .options import StorageOptions

# The pip extra that brings each protocol's library.
EXTRAS = {"s3": ("s3fs", "s3"), "s3a": ("s3fs", "s3"), "gs": ("gcsfs", "gcs"), "gcs": ("gcsfs", "gcs")}
READ_BLOCK = 8 << 20  # bytes fetched per request when streaming an object
LINE_BUFFER = 1 << 20


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
    """Turn a cloud library's exception into a ``StorageError`` naming the URL and the cause,
    leaving the ones callers act on (not found, exists) as they are."""

    @wraps(method)
    def call(self: FsspecStore, path: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, path, *args, **kwargs)
        except (FileNotFoundError, FileExistsError, StorageError):
            raise
        except Exception as e:
            raise StorageError(f"{self.url(path)}: {describe(e)}") from None

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


class FsspecStore(Store):
    """An object store through fsspec. Paths are ``bucket/key``; directories are key prefixes."""

    def __init__(self, protocol: str, options: StorageOptions):
        lib, extra = EXTRAS.get(protocol, (protocol, protocol))
        try:
            import fsspec

            kwargs = {**_retry_kwargs(protocol, options), **options.fsspec_kwargs(protocol)}
            self.fs = fsspec.filesystem(protocol, **kwargs)
        except ImportError:
            raise StorageError(f"{protocol}:// paths need {lib}: pip install 'batchgen[{extra}]'") from None
        except ValueError as e:
            raise StorageError(f"{protocol}://: {e}") from None
        self.scheme = protocol
        self.options = options

    def _fresh(self, path: str) -> None:
        self.fs.invalidate_cache(path)

    @_mapped
    def exists(self, path: str) -> bool:
        self._fresh(path)
        return bool(self.fs.exists(path))

    @_mapped
    def is_dir(self, path: str) -> bool:
        self._fresh(path)
        return bool(self.fs.isdir(path))

    @_mapped
    def is_file(self, path: str) -> bool:
        self._fresh(path)
        return bool(self.fs.isfile(path))

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
        return io.BufferedReader(raw, buffer_size=LINE_BUFFER)  # type: ignore[arg-type]

    @_mapped
    def publish(self, path: str, write: Writer, create_only: bool = False) -> bool:
        fd, name = tempfile.mkstemp(prefix=".batchgen-", suffix=".upload")
        os.close(fd)
        tmp = Path(name)
        try:
            write(tmp)
            try:
                self.fs.put_file(str(tmp), path, mode="create" if create_only else "overwrite")
            except FileExistsError:
                return self._is_ours(path, tmp)
            self._fresh(path)
            return True
        finally:
            tmp.unlink(missing_ok=True)

    def _is_ours(self, path: str, tmp: Path) -> bool:
        """Whether the object a create-only PUT was refused for holds exactly our bytes: a retried
        PUT (after a lost response or a throttled reply) is refused by the object its own first
        attempt created. A single PUT's ETag is the MD5 of its content (hex on S3, base64 in GCS's
        md5Hash)."""
        self._fresh(path)
        info = self.info(path)
        if info.size != tmp.stat().st_size or not info.etag:
            return False
        digest = hashlib.md5(usedforsecurity=False)
        with open(tmp, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
        return info.etag in (digest.hexdigest(), base64.b64encode(digest.digest()).decode())

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


def _file_info(entry: dict[str, Any]) -> FileInfo:
    mtime = entry.get("LastModified") or entry.get("mtime") or entry.get("updated") or 0
    if hasattr(mtime, "timestamp"):
        mtime = mtime.timestamp()
    elif isinstance(mtime, str):
        from datetime import datetime

        mtime = datetime.fromisoformat(mtime.replace("Z", "+00:00")).timestamp()
    etag = entry.get("ETag") or entry.get("etag") or entry.get("md5Hash")
    return FileInfo(int(entry.get("size") or 0), float(mtime), etag.strip('"') if isinstance(etag, str) else None)


def _retry_kwargs(protocol: str, options: StorageOptions) -> dict[str, Any]:
    """Bounded retries with backoff for transient failures (throttling, dropped connections)."""
    if protocol not in ("s3", "s3a"):
        return {}
    return {"config_kwargs": {"retries": {"max_attempts": options.retries, "mode": "standard"},
                              "connect_timeout": 10, "read_timeout": 60}}
