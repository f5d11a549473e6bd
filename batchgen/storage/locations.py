"""``Location``: a file or directory on some store, local or a bucket, with the few path
operations the job code needs. Every path a job names (input, output, merge target) becomes one,
so the job code has a single code path whatever the store."""

from __future__ import annotations

import json
import os
import posixpath
import re
import threading
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO

from .options import StorageOptions
from .stores import FileInfo, FsspecStore, LocalStore, Store, Writer

_URL = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://(.*)$")
_LOCAL = LocalStore()
_stores: dict[tuple[str, str], Store] = {}
_lock = threading.Lock()


def is_url(text: str | os.PathLike[str]) -> bool:
    m = _URL.match(str(text))
    return bool(m) and m.group(1).lower() != "file"


def store_for(protocol: str, options: StorageOptions | None = None) -> Store:
    """One store per protocol and options in a process (clients are costly to make)."""
    options = options or StorageOptions()
    key = (protocol, json.dumps(options.model_dump(mode="json"), sort_keys=True))
    with _lock:
        if key not in _stores:
            _stores[key] = FsspecStore(protocol, options)
        return _stores[key]


@dataclass(frozen=True)
class Location:
    store: Store
    path: str  # local: an absolute path; a bucket: "bucket/key/..."

    @classmethod
    def local_path(cls, path: str | os.PathLike[str]) -> Location:
        return cls(_LOCAL, os.path.abspath(os.path.expanduser(os.fspath(path))))

    def __str__(self) -> str:
        return self.store.url(self.path)

    def __repr__(self) -> str:
        return f"Location({str(self)!r})"

    def __hash__(self) -> int:
        return hash((self.store.scheme, self.path))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Location) and (self.store.scheme, self.path) == (other.store.scheme, other.path)

    # ---------------------------------------------------------------------------- path algebra

    def __truediv__(self, name: str) -> Location:
        if self.is_local:
            return Location.local_path(os.path.join(self.path, name))
        return Location(self.store, posixpath.join(self.path, name) if self.path else name)

    @property
    def name(self) -> str:
        return posixpath.basename(self.path.rstrip("/"))

    @property
    def suffix(self) -> str:
        return PurePosixPath(self.name).suffix

    @property
    def suffixes(self) -> list[str]:
        return PurePosixPath(self.name).suffixes

    @property
    def parent(self) -> Location:
        return Location(self.store, posixpath.dirname(self.path.rstrip("/")))

    def with_name(self, name: str) -> Location:
        return self.parent / name

    @property
    def is_local(self) -> bool:
        return self.store.is_local

    @property
    def local(self) -> Path:
        if not self.is_local:
            raise ValueError(f"{self} is not a local path")
        return Path(self.path)

    def is_under(self, other: Location) -> bool:
        if self.store.scheme != other.store.scheme:
            return False
        mine, theirs = self.path, other.path
        if self.is_local:
            mine, theirs = os.path.realpath(mine), os.path.realpath(theirs)
        return mine == theirs or mine.startswith(theirs.rstrip("/") + "/")

    def relative_to(self, other: Location) -> str | None:
        """This location's path below ``other``, or None when it is not below it."""
        if not self.is_under(other):
            return None
        mine, theirs = self.path, other.path
        if self.is_local:
            mine, theirs = os.path.realpath(mine), os.path.realpath(theirs)
        return posixpath.relpath(mine, theirs)

    # ------------------------------------------------------------------------------ store calls

    def exists(self) -> bool:
        return self.store.exists(self.path)

    def is_dir(self) -> bool:
        return self.store.is_dir(self.path)

    def is_file(self) -> bool:
        return self.store.is_file(self.path)

    def info(self) -> FileInfo:
        return self.store.info(self.path)

    def list_files(self) -> dict[Location, FileInfo]:
        """The files directly in this directory, with their size and time."""
        return {Location(self.store, p): info for p, info in self.store.list_files(self.path).items()}

    def walk_files(self) -> dict[Location, FileInfo]:
        """Every file under this directory (or key prefix) at any depth, with its size, time and
        ETag; a file gives itself. Nothing there: an empty dict."""
        return {Location(self.store, p): info for p, info in self.store.walk_files(self.path).items()}

    def expand(self) -> list[Location]:
        """The files this location names as a glob pattern (``**`` crosses directories), sorted."""
        return [Location(self.store, p) for p in self.store.glob(self.path)]

    def open_read(self) -> IO[bytes]:
        return self.store.open_read(self.path)

    def arrow_source(self) -> str | IO[bytes]:
        """What pyarrow should read: the path of a local file (it opens and maps it itself), or a
        stream over a bucket object (fetched in ranges as pyarrow asks for them)."""
        return self.path if self.is_local else self.open_read()

    def read_bytes(self) -> bytes:
        with self.open_read() as f:
            return f.read()

    def read_text(self) -> str:
        return self.read_bytes().decode("utf-8")

    def publish(self, write: Writer, create_only: bool = False) -> bool:
        """Write the whole file at once (see ``Store.publish``); False if ``create_only`` and it exists."""
        return self.store.publish(self.path, write, create_only)

    def publish_bytes(self, data: bytes, create_only: bool = False) -> bool:
        return self.publish(lambda tmp: tmp.write_bytes(data), create_only)

    def remove(self, missing_ok: bool = True) -> None:
        self.store.remove(self.path, missing_ok)

    def prepare_dir(self) -> None:
        self.store.prepare_dir(self.path)


def location(text: str | os.PathLike[str] | Location, base: Location | Path | str | None = None,
             options: StorageOptions | None = None) -> Location:
    """A path or URL as a ``Location``; relative paths are relative to ``base`` (a directory)."""
    if isinstance(text, Location):
        return text
    raw = os.fspath(text)
    m = _URL.match(raw)
    if m:
        protocol, rest = m.group(1).lower(), m.group(2)
        if protocol == "file":
            return Location.local_path(rest)
        return Location(store_for(protocol, options), rest.rstrip("/") if rest.count("/") else rest)
    expanded = os.path.expanduser(raw)
    if os.path.isabs(expanded) or base is None:
        return Location.local_path(expanded)
    return location(base, options=options) / raw
