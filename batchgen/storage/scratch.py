"""Scratch files and dirs in the system temp dir (a part's copy on its way to a bucket, an input file's id
index, spilled ids), named after the host and process that made them, so that a later run on the same
host removes what a killed run left there: a preempted node that runs batchgen from cron for months
would otherwise fill its /tmp with part-sized orphans. A run that ends removes its own."""

from __future__ import annotations

import os
import re
import shutil
import socket
import tempfile
from pathlib import Path

_TAG = ".batchgen-"


def scratch_prefix(kind: str) -> str:
    """The name prefix of this process's scratch entries of ``kind`` (letters only)."""
    return f"{_TAG}{kind}-{_host()}-{os.getpid()}-"


def sweep_orphans(root: str | Path | None = None) -> int:
    """Remove the scratch entries under ``root`` (the system temp dir) of this host's processes that are
    gone; the number removed. Entries of other hosts (a temp dir shared over NFS) are left alone."""
    mine = re.compile(rf"{re.escape(_TAG)}[a-z]+-{re.escape(_host())}-(\d+)-")
    removed = 0
    try:
        entries = list(os.scandir(root or tempfile.gettempdir()))
    except OSError:
        return 0
    for entry in entries:
        found = mine.match(entry.name)
        if not found or _alive(int(found[1])):
            continue
        try:
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)
            removed += 1
        except OSError:  # another run swept it first, or not ours to remove
            pass
    return removed


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname()) or "host"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: another user's live process
        return True
    return True


def scratch_dir(kind: str) -> tempfile.TemporaryDirectory[str]:
    return tempfile.TemporaryDirectory(prefix=scratch_prefix(kind))


def scratch_file(kind: str, suffix: str = "") -> Path:
    """A new empty file (the caller removes it)."""
    fd, name = tempfile.mkstemp(prefix=scratch_prefix(kind), suffix=suffix)
    os.close(fd)
    return Path(name)
