"""One run per (output dir, shard) at a time: the lock ``OUTPUT/.locks/shard-I-of-N.lock``.

Locally it is an ``flock`` (dropped by the kernel however its holder dies); on a bucket a lease
that the run renews while it lives and that another run takes over once it has expired
(``batchgen.storage.locks``, lease time ``storage.lease_seconds``, default 60 s). A run whose
lease was taken over stops before its next part, so it never writes next to the new holder.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path

from ...storage import Location, location
from ...storage.locks import Lock, LockHeld, LockLost, lock_for
from ..errors import JobError, LockedError
from ..shard import Shard

LOCK_DIR = ".locks"
MAX_WAIT_ROUND = 60.0  # seconds slept at once while waiting out a lease; then the lease is read again
LOCK_RE = re.compile(r"^shard-(\d{5})-of-(\d{5})\.lock$")


def lock_path(out_dir: Location, shard: Shard) -> Location:
    return out_dir / LOCK_DIR / f"shard-{shard.tag}.lock"


def _may_wait_out(held: LockHeld, waited_on: int | None) -> bool:
    """Whether to wait for a held lease to expire: it is held from another host (a live holder here
    renews it), and it has not been renewed since this run began to wait."""
    if held.expires_in is None or held.here:
        return False
    return waited_on is None or held.generation == waited_on


class ShardLock:
    def __init__(self, out_dir: Location | Path, shard: Shard, lease_seconds: float = 60.0):
        self.out_dir = out_dir = location(out_dir)
        self.shard = shard
        self.lock: Lock = lock_for(lock_path(out_dir, shard), lease_seconds)

    def acquire(self, wait: float = 0.0, notify: Callable[[str], None] | None = None) -> ShardLock:
        """Take the lock, waiting up to ``wait`` seconds for another holder to go (a retried Ray
        task waits so for the lease of the attempt that was killed). A bucket lease held from another
        host is waited out (said through ``notify``) and taken over unless renewed meanwhile; one whose
        holder was a process of this host that is gone is taken over at once."""
        deadline = time.monotonic() + wait
        waited_on: int | None = None  # the lease generation this run waits to expire
        while True:
            try:
                self.lock.acquire()
                self._tell_takeover(notify)
                return self
            except LockHeld as e:
                if _may_wait_out(e, waited_on):
                    if waited_on is None and notify is not None:
                        notify(f"shard {self.shard} of {self.out_dir}: {e}; waiting for it to expire")
                    waited_on = e.generation
                    time.sleep(min(max(0.05, (e.expires_in or 0) + 0.1), MAX_WAIT_ROUND))
                    continue
                if time.monotonic() < deadline:
                    time.sleep(min(1.0, max(0.05, deadline - time.monotonic())))
                    continue
                renewed = " (renewed while this run waited: its holder is alive)" if waited_on is not None else ""
                raise LockedError(f"another batchgen run is already working on shard {self.shard} of "
                                  f"{self.out_dir} ({e}){renewed}; not starting a second one") from None
            except OSError as e:
                raise JobError(f"cannot lock shard {self.shard} of {self.out_dir}: {e}") from None

    def _tell_takeover(self, notify: Callable[[str], None] | None) -> None:
        took_over = getattr(self.lock, "took_over", None)
        if took_over and notify is not None:
            notify(f"shard {self.shard} of {self.out_dir}: took its lease over at once ({took_over})")

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
