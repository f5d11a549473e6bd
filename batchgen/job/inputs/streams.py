"""Opening input files through the storage layer, local or in a bucket, as streams: nothing here
reads a whole file. A file that cannot be opened is a ``JobError`` naming it."""

from __future__ import annotations

import gzip
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO

from ..errors import JobError
from .rows import InputFile


def open_binary(f: InputFile) -> IO[bytes]:
    try:
        return f.path.open_read()
    except OSError as e:
        raise JobError(f"cannot read input file {f.name}: {e}") from None


@contextmanager
def open_decompressed(f: InputFile) -> Iterator[IO[bytes]]:
    """The file's bytes, gunzipped on the fly for a ``.gz`` name."""
    with open_binary(f) as raw:
        yield gzip.GzipFile(fileobj=raw, mode="rb") if f.path.suffix == ".gz" else raw  # type: ignore[misc]
