"""One holder at a time for a named lock, on any store.

Locally: ``flock`` on the lock file. The kernel drops it when its holder dies, however it dies,
so a killed run never leaves a stale lock; the file stays (removing it would race a new holder).

On a bucket (no flock, no rename): a lease. The lock is a series of objects ``NAME.lease.G``
(G = 1, 2, ...), each created with a create-only conditional write, so of two writers of the same
G only one succeeds. The holder is whoever created the highest G; it renews by creating G+1
every third of the lease time, and a renewal refused means another run took over (the lock is
then *lost* and the holder must stop writing). A run that finds the highest G expired (its
holder stopped renewing: killed, or cut off) takes over by creating G+1; one that finds it
released (its holder ended) does the same at once. Nothing but create-only writes is needed,
which S3 (``If-None-Match: *``), GCS (``ifGenerationMatch=0``) and MinIO all support.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import socket
import threading
import time
import uuid
from dataclasses import dataclass

from .locations import Location
from .stores import StorageError

_LEASE = re.compile(r"^(?P<name>.+)\.lease\.(?P<gen>\d{10})$")


class LockHeld(StorageError):
    """Another process holds the lock; the message names it. For a lease: the seconds ``expires_in`` and
    the ``generation`` held, and whether the holder runs on this host (``here``: then it is alive)."""

    def __init__(self, message: str, expires_in: float | None = None, generation: int = 0, here: bool = False):
        super().__init__(message)
        self.expires_in, self.generation, self.here = expires_in, generation, here


class LockLost(StorageError):
    """This process held a lease and another run has taken it over."""


_HOLDER = re.compile(r"^pid (?P<pid>\d+) on (?P<host>\S+)$")


def holder_text() -> str:
    return f"pid {os.getpid()} on {socket.gethostname()}"


def holder_here(holder: str) -> int | None:
    """The pid of a holder (``holder_text``) on this host; None for one elsewhere."""
    m = _HOLDER.match(holder)
    return int(m.group("pid")) if m and m.group("host") == socket.gethostname() else None


def holder_gone(holder: str) -> bool:
    """Whether a lock's holder is a process of this host that is not running any more."""
    pid = holder_here(holder)
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # running, as another user
        return False
    return False


@dataclass
class LockState:
    name: str  # the lock's name (without a lease's generation)
    mtime: float
    held: bool
    lease: Lease | None = None  # a bucket lock's newest lease

    @property
    def note(self) -> str | None:
        """What a held lease says of its holder, where that is more than "running": ``stale (holder ... is
        not running)`` for a holder of this host that is gone, ``lease expires in Ns`` for one elsewhere."""
        if not self.held or self.lease is None:
            return None
        if holder_gone(self.lease.holder):
            return f"stale (holder {self.lease.holder} is not running)"
        if holder_here(self.lease.holder) is not None:
            return None
        return f"lease expires in {max(0.0, self.lease.expires - time.time()):.0f}s"


class Lock:
    """``with lock_for(loc, lease):`` around the work; ``check()`` before each write it guards."""

    warning: str | None = None

    def acquire(self) -> Lock:
        raise NotImplementedError

    def release(self) -> None:
        raise NotImplementedError

    def check(self) -> None:
        """Raise ``LockLost`` if this process no longer holds the lock."""

    def __enter__(self) -> Lock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def lock_for(loc: Location, lease_seconds: float = 60.0) -> Lock:
    return FileLock(loc) if loc.is_local else LeaseLock(loc, lease_seconds)


def lock_states(directory: Location) -> list[LockState]:
    """The locks in a directory, oldest first: whether each is held now, and when it was last taken."""
    states: dict[str, LockState] = {}
    files = directory.list_files()
    for loc, info in sorted(files.items(), key=lambda kv: kv[0].name):
        m = _LEASE.match(loc.name)
        if m:
            name = m.group("name")
            state = states.setdefault(name, LockState(name, info.mtime, False))
            state.mtime = max(state.mtime, info.mtime)
        elif loc.is_local and not loc.name.startswith("."):
            states[loc.name] = LockState(loc.name, info.mtime, _flock_held(loc))
    for name, state in states.items():
        if not directory.is_local:
            top = _leases(directory / name, files)
            state.lease = _read_lease(top[-1][1]) if top else None
            state.held = state.lease is not None and state.lease.live
    return sorted(states.values(), key=lambda s: s.mtime)


# -------------------------------------------------------------------------------------- flock


class FileLock(Lock):
    retry_seconds = 0.5  # absorbs a ``status`` probing the lock at the same instant

    def __init__(self, loc: Location):
        self.path = loc.local
        self._fd: int | None = None

    def acquire(self) -> FileLock:
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
                    raise LockHeld(holder) from None
                time.sleep(0.05)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{holder_text()}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def _flock_held(loc: Location) -> bool:
    """Whether some process holds this lock file now (probes it for an instant)."""
    try:
        fd = os.open(loc.local, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops the shared lock if we got it
    return False


# -------------------------------------------------------------------------------------- lease


@dataclass
class Lease:
    holder: str
    expires: float
    released: bool

    @property
    def live(self) -> bool:
        return not self.released and self.expires > time.time()


def _read_lease(loc: Location) -> Lease:
    try:
        data = json.loads(loc.read_bytes())
        return Lease(str(data.get("holder", "unknown")), float(data.get("expires", 0)), bool(data.get("released")))
    except FileNotFoundError:  # deleted as superseded just now: whoever wrote the next one holds it
        return Lease("unknown", 0.0, True)
    except (ValueError, TypeError, AttributeError):
        return Lease("unknown (unreadable lease)", 0.0, False)


def _leases(loc: Location, files: dict[Location, object] | None = None) -> list[tuple[int, Location]]:
    """(generation, object) of a lease's objects, lowest first."""
    files = loc.parent.list_files() if files is None else files
    out = []
    for f in files:
        m = _LEASE.match(f.name)
        if m and m.group("name") == loc.name:
            out.append((int(m.group("gen")), f))
    return sorted(out, key=lambda x: x[0])


class LeaseLock(Lock):
    tries = 3  # rounds of read-then-create when other runs race for an expired lease

    def __init__(self, loc: Location, lease_seconds: float):
        self.loc = loc
        self.lease = lease_seconds
        self.gen = 0
        self.expires = 0.0
        self.lost: str | None = None
        self.took_over: str | None = None  # why a live lease was taken over (its holder is gone)
        self.token = uuid.uuid4().hex  # makes every lease object's bytes this holder's own
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._mutex = threading.Lock()

    def _object(self, gen: int) -> Location:
        return self.loc.with_name(f"{self.loc.name}.lease.{gen:010d}")

    def _create(self, gen: int, released: bool = False) -> bool:
        expires = time.time() + (0 if released else self.lease)
        body = json.dumps({"holder": holder_text(), "expires": expires, "released": released,
                           "lease_seconds": self.lease, "token": self.token}).encode()
        if not self._object(gen).publish_bytes(body, create_only=True):
            return False
        self.gen, self.expires = gen, expires
        return True

    def acquire(self) -> LeaseLock:
        self.warning = _create_only_warning(self.loc.parent)
        for _ in range(self.tries):
            found = _leases(self.loc)
            top = found[-1][0] if found else 0
            if found:
                self._check_holder(_read_lease(found[-1][1]), top)
            if self._create(top + 1):
                self._prune(found)
                self._thread = threading.Thread(target=self._renew, name="batchgen-lease", daemon=True)
                self._thread.start()
                return self
        raise LockHeld("other runs are taking the lease at the same time")

    def _check_holder(self, lease: Lease, generation: int) -> None:
        """Raise ``LockHeld`` if the lease's holder may still be writing: its lease is live, and it is
        not a process of this host that is gone (a killed run's lease is taken over at once)."""
        if not lease.live:
            return
        if holder_gone(lease.holder):
            self.took_over = f"{lease.holder} is not running"
            return
        left = lease.expires - time.time()
        raise LockHeld(f"{lease.holder}; its lease expires in {left:.0f}s unless renewed", left, generation,
                       holder_here(lease.holder) is not None)

    def _prune(self, older: list[tuple[int, Location]]) -> None:
        for _, loc in older:
            try:
                loc.remove()
            except OSError:  # only tidiness: the highest generation decides
                pass

    def _renew(self) -> None:
        while not self._stop.wait(self.lease / 3):
            with self._mutex:
                if self.lost:
                    return
                previous = self._object(self.gen)
                try:
                    if not self._create(self.gen + 1):
                        self.lost = "another run created the next lease first"
                        return
                except OSError as e:
                    if time.time() >= self.expires:
                        self.lost = f"the lease could not be renewed before it expired ({e})"
                        return
                    continue
                self._prune([(0, previous)])

    def check(self) -> None:
        if self.lost is None and time.time() >= self.expires:
            self.lost = "the lease expired before it was renewed (a paused or cut-off run)"
        if self.lost:
            raise LockLost(f"lost the lock {self.loc}: {self.lost}; this run stops writing")

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._mutex:
            if self.lost or not self.gen:
                return
            previous = self._object(self.gen)
            try:
                if self._create(self.gen + 1, released=True):
                    self._prune([(0, previous)])
            except OSError:  # it expires by itself
                pass


_probed: dict[str, str | None] = {}


def _create_only_warning(directory: Location) -> str | None:
    """Whether the store refuses a second create-only write of one object (once per bucket)."""
    key = f"{directory.store.scheme}://{directory.path.split('/', 1)[0]}"
    if key not in _probed:
        probe = directory / f".probe-{uuid.uuid4().hex}"
        try:
            probe.publish_bytes(b"1", create_only=True)
            refused = not probe.publish_bytes(b"2", create_only=True)
        finally:
            probe.remove()
        _probed[key] = None if refused else (
            f"{key} ignores conditional writes (If-None-Match): two runs of one shard started at the same "
            "moment are not kept apart there; run each shard once at a time (as Slurm arrays do)")
    return _probed[key]
