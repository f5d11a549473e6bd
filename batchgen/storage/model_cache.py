"""A node-local copy of a model kept in a bucket (``model.path: s3://bucket/models/NAME``).

The first run on a node copies the files into ``$BATCHGEN_CACHE/models`` (default
``~/.cache/batchgen/models``); later runs check the copy against one listing of the bucket and use it.

- One copier per node: the copy runs under an flock on a lock file next to the copy, so concurrent
  runs (the tasks of a Slurm array on one node) wait for it and then find the files there; the
  model crosses the network once. The kernel drops the lock when its holder dies, however it dies.
- Resumable, file by file: a file is written under a temp name, fsynced and renamed into place when
  whole, and only then recorded in a manifest with the size and ETag the bucket listed for it. A
  later run fetches only the files that are not recorded, or whose size or ETag changed since, and
  removes the ones the bucket no longer has.
- Checked: a copied file must have the listed size, and the object must still have the listed ETag
  after the copy (an object replaced in the middle of its copy is not recorded).

Layout, for ``s3://bucket/models/NAME``::

    $BATCHGEN_CACHE/models/s3/bucket/models/NAME/            the model directory the engine loads
    $BATCHGEN_CACHE/models/s3/bucket/models/.NAME.batchgen/  lock, manifest.json, partial/ (temp files)

A store reached through a custom endpoint (``AWS_ENDPOINT_URL``, ``storage.endpoint_url``) gets its
own tree (``s3+HOST_PORT/...``), so two stores with the same bucket names do not share copies.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

from .locations import Location
from .locks import holder_text
from .stores import FileInfo, StorageError

CACHE_ENV = "BATCHGEN_CACHE"
CHUNK = 8 << 20  # bytes per read while copying
PROGRESS_EVERY = 512 << 20  # a progress line each time this many more bytes have arrived
WORKERS = 4  # files copied at once (a sharded checkpoint's files in parallel)

Log = Callable[[str], None]


def stderr_log(text: str) -> None:
    print(f"batchgen: {text}", file=sys.stderr, flush=True)


def cache_root() -> Path:
    """``$BATCHGEN_CACHE``, else ``~/.cache/batchgen`` (the GGUF conversions live there too)."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "batchgen").expanduser()


def size_text(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class RemoteFile:
    loc: Location
    info: FileInfo


class ModelCache:
    """The local copy of the model directory at ``source`` (a bucket prefix, or one object)."""

    def __init__(self, source: Location, root: Path | None = None, log: Log = stderr_log):
        if source.is_local:
            raise ValueError(f"{source} is a local path; only a bucket's model is copied into the cache")
        self.source = source
        self.dir = (root or cache_root()) / "models" / _store_key(source) / Path(*PurePosixPath(source.path).parts)
        self.meta = self.dir.with_name(f".{self.dir.name}.batchgen")
        self.log = log

    @property
    def lock_file(self) -> Path:
        return self.meta / "lock"

    @property
    def manifest_file(self) -> Path:
        return self.meta / "manifest.json"

    @property
    def partial_dir(self) -> Path:
        return self.meta / "partial"

    # --------------------------------------------------------------------------------- listing

    def remote_files(self) -> dict[str, RemoteFile]:
        """The model's files in the bucket by relative path (one listing); a one-line
        ``StorageError`` when the bucket or the prefix does not exist."""
        try:
            found = self.source.walk_files()
        except FileNotFoundError:
            found = {}
        if not found:
            self.source.store.prepare_dir(self.source.path)  # raises "no such bucket" for a missing one
            raise StorageError(f"{self.source}: no files there (nothing under that prefix)")
        out = {}
        for loc, info in found.items():
            rel = loc.name if loc == self.source else loc.relative_to(self.source)
            if rel is None or any(part in ("", ".", "..") for part in rel.split("/")):
                raise StorageError(f"{loc}: a key that cannot be a file of {self.dir}")
            out[rel] = RemoteFile(loc, info)
        return out

    def is_current(self, remote: dict[str, RemoteFile]) -> bool:
        """Whether the local copy holds every listed file as listed (nothing to fetch)."""
        manifest = self._read_manifest()
        return all(self._current(rel, f.info, manifest) for rel, f in remote.items())

    # ---------------------------------------------------------------------------------- fetch

    def fetch(self, remote: dict[str, RemoteFile] | None = None) -> Path:
        """The local model directory, copied or brought up to date first if needed."""
        remote = self.remote_files() if remote is None else remote
        if self.is_current(remote):  # the common case: no lock, no waiting
            self.log(f"model {self.source}: using the copy in {self.dir}")
            return self.dir
        with self._locked():
            manifest = self._read_manifest()
            self._drop_stale(remote, manifest)
            todo = [rel for rel, f in remote.items() if not self._current(rel, f.info, manifest)]
            if not todo:
                self.log(f"model {self.source}: copied by another run; using {self.dir}")
                return self.dir
            self._copy(todo, remote, manifest)
        return self.dir

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """Hold the node's lock on this copy, waiting (and saying so) while another run holds it."""
        self.meta.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.lock_file, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
                self.log(f"model {self.source}: waiting for {holder}, which is copying it into {self.dir}")
                fcntl.flock(fd, fcntl.LOCK_EX)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{holder_text()}\n".encode(), 0)
            yield
        finally:
            os.close(fd)  # drops the lock

    def _copy(self, todo: list[str], remote: dict[str, RemoteFile], manifest: dict[str, Any]) -> None:
        total = sum(remote[rel].info.size for rel in todo)
        have = len(remote) - len(todo)
        kept = f"; {have} already here" if have else ""
        self.log(f"model {self.source}: copying {len(todo)} file{'s' if len(todo) != 1 else ''} "
                 f"({size_text(total)}) into {self.dir}{kept}")
        shutil.rmtree(self.partial_dir, ignore_errors=True)  # left by a run that died: we hold the lock
        self.partial_dir.mkdir(parents=True)
        progress = _Progress(f"model {self.source}", total, len(todo), self.log)
        mutex = threading.Lock()

        def copy_one(rel: str) -> None:
            f = remote[rel]
            with mutex:  # the old record goes first: a crash during the rename must not leave it claiming the file
                if manifest.pop(rel, None) is not None:
                    self._write_manifest(manifest)
            self._copy_file(rel, f, progress)
            with mutex:
                manifest[rel] = {"size": f.info.size, "etag": f.info.etag, "mtime": f.info.mtime}
                self._write_manifest(manifest)
            progress.file_done(rel, f.info.size)

        order = sorted(todo, key=lambda rel: (remote[rel].info.size, rel))  # config and tokenizer first
        with ThreadPoolExecutor(min(WORKERS, len(order)), thread_name_prefix="batchgen-fetch") as pool:
            futures = [pool.submit(copy_one, rel) for rel in order]
        errors = [e for e in (f.exception() for f in futures) if e is not None]
        shutil.rmtree(self.partial_dir, ignore_errors=True)
        if errors:
            first = errors[0]
            if isinstance(first, StorageError):
                raise first
            if isinstance(first, OSError):
                raise StorageError(f"copying {self.source} into {self.dir}: {first}") from None
            raise first
        self.log(f"model {self.source}: copied {len(todo)} file{'s' if len(todo) != 1 else ''} "
                 f"({size_text(total)}) in {time.monotonic() - progress.start:.1f}s")

    def _copy_file(self, rel: str, f: RemoteFile, progress: _Progress) -> None:
        target = self.dir / rel
        tmp = self.partial_dir / (rel.replace("/", "%") + ".part")
        with f.loc.open_read() as src, open(tmp, "wb") as dst:
            while chunk := src.read(CHUNK):
                dst.write(chunk)
                progress.add(len(chunk))
            dst.flush()
            os.fsync(dst.fileno())
        got = tmp.stat().st_size
        if got != f.info.size:
            raise StorageError(f"{f.loc}: the copy has {got} bytes but the listing said {f.info.size}; run again")
        now = f.loc.info()
        if (now.size, now.etag) != (f.info.size, f.info.etag):
            raise StorageError(f"{f.loc}: the object changed while it was copied; run again")
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, target)

    # ------------------------------------------------------------------------------- manifest

    def _current(self, rel: str, info: FileInfo, manifest: dict[str, Any]) -> bool:
        record = manifest.get(rel)
        if not isinstance(record, dict) or record.get("size") != info.size:
            return False
        if info.etag is not None:
            if record.get("etag") != info.etag:
                return False
        elif record.get("mtime") != info.mtime:  # a store without ETags: its modification time
            return False
        try:
            return (self.dir / rel).stat().st_size == info.size
        except OSError:
            return False

    def _drop_stale(self, remote: dict[str, RemoteFile], manifest: dict[str, Any]) -> None:
        """Remove the files this cache copied that the bucket no longer has."""
        gone = [rel for rel in manifest if rel not in remote]
        for rel in gone:
            (self.dir / rel).unlink(missing_ok=True)
            del manifest[rel]
        if gone:
            self._write_manifest(manifest)

    def _read_manifest(self) -> dict[str, Any]:
        try:
            data = json.loads(self.manifest_file.read_text())
        except (OSError, ValueError):
            return {}
        if not isinstance(data, dict) or data.get("source") != str(self.source):
            return {}
        files = data.get("files")
        return files if isinstance(files, dict) else {}

    def _write_manifest(self, files: dict[str, Any]) -> None:
        tmp = self.manifest_file.with_name(f".manifest.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"source": str(self.source), "files": files}, indent=1, sort_keys=True))
        os.replace(tmp, self.manifest_file)


class _Progress:
    """Plain progress lines (batch logs have no terminal): one per file, one per PROGRESS_EVERY bytes."""

    def __init__(self, label: str, total: int, files: int, log: Log):
        self.label, self.total, self.files, self.log = label, total, files, log
        self.done = self.files_done = 0
        self.mark = PROGRESS_EVERY
        self.start = time.monotonic()
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        with self._lock:
            self.done += n
            if self.done < self.mark or self.done >= self.total:
                return
            self.mark = (self.done // PROGRESS_EVERY + 1) * PROGRESS_EVERY
            elapsed = max(time.monotonic() - self.start, 1e-6)
            self.log(f"{self.label}: {size_text(self.done)} of {size_text(self.total)} "
                     f"({100 * self.done / self.total:.0f}%), {size_text(self.done / elapsed)}/s")

    def file_done(self, rel: str, size: int) -> None:
        with self._lock:
            self.files_done += 1
            self.log(f"{self.label}: {rel} ({size_text(size)}) done, {self.files_done} of {self.files} files")


def _store_key(loc: Location) -> str:
    """The cache tree of a store: its scheme, with the host of a custom endpoint."""
    scheme = loc.store.scheme
    options = getattr(loc.store, "options", None)
    endpoint = getattr(options, "endpoint_url", None)
    if not endpoint and scheme in ("s3", "s3a"):
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if not endpoint:
        return scheme
    host = urlsplit(endpoint).netloc or endpoint
    return f"{scheme}+{re.sub(r'[^A-Za-z0-9.-]', '_', host)}"
