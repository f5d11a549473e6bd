"""One run per (output dir, shard) at a time, via ``flock`` on ``OUTPUT/.locks/shard-I-of-N.lock``.

The kernel drops a flock when its holder dies, however it dies, so a crashed or killed run never
leaves a stale lock behind; the file itself stays (removing it would race with a new holder).
The holder writes its pid and host into the file, only for the message a refused run prints.
"""

from __future__ import annotations

import fcntl
import os
import re
import socket
import time
from pathlib import Path

from .errors import LockedError
from .shard import Shard

LOCK_DIR = ".locks"
LOCK_RE = re.compile(r"^shard-(\d{5})-of-(\d{5})\.lock$")


def lock_path(out_dir: Path, shard: Shard) -> Path:
    return out_dir / LOCK_DIR / f"shard-{shard.tag}.lock"


class ShardLock:
    # A brief retry absorbs a ``batchgen status`` probing the lock at the same instant.
    retry_seconds = 0.5

    def __init__(self, out_dir: Path, shard: Shard):
        self.path = lock_path(out_dir, shard)
        self.shard = shard
        self._fd: int | None = None

    def acquire(self) -> ShardLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + self.retry_seconds
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
                    os.close(fd)
                    raise LockedError(
                        f"another batchgen run is already working on shard {self.shard} of "
                        f"{self.path.parent.parent} ({holder}); not starting a second one") from None
                time.sleep(0.05)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> ShardLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def is_locked(path: Path) -> bool:
    """Whether some process holds this lock now (probes it for an instant)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops the shared lock if we got it
    return False
