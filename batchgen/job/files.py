"""Writing files so that they exist whole or not at all, as parts and the saved job need."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from .errors import JobError


def write_atomic(final: Path, write: Callable[[Path], object], tmp: Path | None = None) -> None:
    """``write(tmp)`` under a hidden temp name, fsync it, rename it into place, fsync the dir.
    Give ``tmp`` when several processes may write ``final`` at once (one temp name each)."""
    tmp = tmp or final.parent / f".{final.name.lstrip('.')}.tmp"
    try:
        write(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, final)
        fsync_dir(final.parent)
    except OSError as e:
        raise JobError(f"cannot write {final}: {e}") from None


def remove_file(path: Path) -> None:
    try:
        path.unlink()
        fsync_dir(path.parent)
    except OSError as e:
        raise JobError(f"cannot remove {path}: {e}") from None


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
