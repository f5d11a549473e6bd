"""One run per (output dir, shard) at a time: the lock ``OUTPUT/.locks/shard-I-of-N.lock``.

Locally it is an ``flock`` (dropped by the kernel however its holder dies); on a bucket a lease
that the run renews while it lives and that another run takes over once it has expired
(``batchgen.storage.locks``, lease time ``storage.lease_seconds``, default 60 s). A run whose
lease was taken over stops before its next part, so it never writes next to the new holder.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

from ...storage import Location, location
from ...storage.locks import Lock, LockHeld, LockLost, lock_for
from ..errors import JobError, LockedError
from ..shard import Shard

LOCK_DIR = ".locks"
LOCK_RE = re.compile(r"^shard-(\d{5})-of-(\d{5})\.lock$")


def lock_path(out_dir: Location, shard: Shard) -> Location:
    return out_dir / LOCK_DIR / f"shard-{shard.tag}.lock"


class ShardLock:
    def __init__(self, out_dir: Location | Path, shard: Shard, lease_seconds: float = 60.0):
        self.out_dir = out_dir = location(out_dir)
        self.shard = shard
        self.lock: Lock = lock_for(lock_path(out_dir, shard), lease_seconds)

    def acquire(self, wait: float = 0.0) -> ShardLock:
        """Take the lock, waiting up to ``wait`` seconds for another holder to go (a retried Ray
        task waits so for the lease of the attempt that was killed)."""
        deadline = time.monotonic() + wait
        while True:
            try:
                self.lock.acquire()
                return self
            except LockHeld as e:
                if time.monotonic() < deadline:
                    time.sleep(min(1.0, max(0.05, deadline - time.monotonic())))
                    continue
                raise LockedError(f"another batchgen run is already working on shard {self.shard} of "
                                  f"{self.out_dir} ({e}); not starting a second one") from None
            except OSError as e:
                raise JobError(f"cannot lock shard {self.shard} of {self.out_dir}: {e}") from None

    @property
    def warning(self) -> str | None:
        return self.lock.warning

    def check(self) -> None:
        """Raises ``JobError`` if another run has taken this shard over (a bucket lease expired)."""
        try:
            self.lock.check()
        except LockLost as e:
            raise JobError(str(e)) from None

    def release(self) -> None:
        self.lock.release()

    def __enter__(self) -> ShardLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
