"""``batchgen ray job.yaml --workers N``: shard i/N of the job as one Ray task per worker.

Each task is ``batchgen run --shard i/N`` in a Ray worker (the same ``Runner``: the shard lock,
atomic parts, resume), so what holds for shards holds here: a task retried by Ray after its node
or process died resumes from the parts already written, and together the shards equal one
unsharded run. The workers report progress to a small actor; the driver polls it and shows one
line for the whole job. A head that stops answering (its GCS) ends the driver within a bounded time
with one line and exit 75, before Ray's own limit ends it with a C++ log; a rerun resumes.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pyarrow.compute as pc

from ..extras import install_hint
from ..job.errors import EXIT_ENGINE, EXIT_INTERRUPTED, EXIT_OK, JobError
from ..job.inputs import InputReader
from ..job.outputs.formats import format_of
from ..job.outputs.writer import complete_ids, list_parts
from ..job.run.progress import Plan, Reporter, Snapshot, duration, make_reporter, rate
from ..job.shard import Shard, shard_of
from ..job.spec import Job
from ..storage import Location

POLL_SECONDS = 0.5
WORKER_UPDATE_SECONDS = 1.0
HEAD_PROBE_SECONDS = 2.0  # one call to the head's GCS (and to the progress board) waits this long at most
CONNECT_SECONDS = 5.0  # the head's port must accept a connection within this (ray.init retries for many minutes)
# Ray ends a driver whose GCS has not answered for this many seconds (default 60), with a C++ log line.
RAY_GCS_LIMIT = "RAY_gcs_rpc_server_reconnect_timeout_s"


class HeadUnavailable(JobError):
    """The Ray cluster's head cannot be reached, or stopped answering mid-run: finished rows are
    saved; run the same command again once it is back (a temporary failure, EX_TEMPFAIL)."""

    exit_code = EXIT_INTERRUPTED


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise JobError(f"Ray is not installed; install it with: {install_hint('ray', 'ray[data]')}") from None
    return ray


@dataclass
class WorkerState:
    """What the driver knows of one shard's task: its latest attempt's plan and counters."""

    shard: str
    attempts: int = 0
    node: str = ""
    done_before: int = 0
    snap: Snapshot = field(default_factory=Snapshot)
    status: str = "waiting"  # waiting | running | complete | interrupted | nothing to do | failed
    error: str = ""
    exit_code: int = EXIT_OK


class ProgressBoard:
    """The Ray actor the workers report to (plain class; ``run_on_ray`` makes it remote)."""

    def __init__(self) -> None:
        self.workers: dict[int, dict[str, Any]] = {}
        self.messages: list[str] = []

    def start(self, index: int, shard: str, node: str, done_before: int) -> None:
        w = self.workers.setdefault(index, {"shard": shard, "attempts": 0})
        w.update(attempts=w["attempts"] + 1, node=node, done_before=done_before,
                 snap=asdict(Snapshot()), status="running")
        if w["attempts"] > 1:
            self.messages.append(f"shard {shard}: attempt {w['attempts']} on {node} resumes from "
                                 f"{done_before:,} rows done")

    def update(self, index: int, snap: dict[str, Any], status: str | None = None) -> None:
        w = self.workers.get(index)
        if w is not None:
            w["snap"] = snap
            if status:
                w["status"] = status

    def message(self, index: int, text: str, shard: str = "?") -> None:
        self.messages.append(f"shard {self.workers.get(index, {}).get('shard', shard)}: {text}")

    def read(self) -> tuple[dict[int, dict[str, Any]], list[str]]:
        messages, self.messages = self.messages, []
        return self.workers, messages


class BoardReporter:
    """A worker's ``Reporter``: forwards to the board, at most once a second for updates."""

    def __init__(self, board: Any, index: int, shard: str = "?"):
        self.board = board
        self.index = index
        self.shard = shard  # for messages before start(), e.g. the engine's start-up steps
        self._next = 0.0

    def start(self, plan: Plan) -> None:
        self.board.start.remote(self.index, str(plan.shard), socket.gethostname(), plan.done_before)

    def idle(self) -> None:
        self.board.update.remote(self.index, asdict(Snapshot()), "nothing to do")

    def update(self, snap: Snapshot, force: bool = False) -> None:
        now = time.monotonic()
        if force or now >= self._next:
            self._next = now + WORKER_UPDATE_SECONDS
            self.board.update.remote(self.index, asdict(snap))

    def message(self, text: str) -> None:
        self.board.message.remote(self.index, text, self.shard)

    def finish(self, snap: Snapshot, status: str) -> None:
        self.board.update.remote(self.index, asdict(snap), status)


def run_shard(job_form: dict[str, Any], index: int, count: int, board: Any, options: dict[str, Any]) -> dict:
    """The body of one Ray task: the job's shard ``index``/``count`` through ``Runner``."""
    from ..job.engine import load_factory
    from ..job.run.runner import Runner
    from ..job.spec import parse_job

    job = parse_job(job_form["text"], Path(job_form["base_dir"]),
                     Path(job_form["source"]) if job_form["source"] else None)
    reporter = BoardReporter(board, index, str(Shard(index, count)))
    # A retried attempt waits out the lease of the attempt it replaces (killed with its node: a
    # bucket lease outlives it by up to the lease time; a local flock is free at once).
    lock_wait = job.spec.storage.lease + 10.0
    result = Runner(job, Shard(index, count), load_factory(options.get("engine")), force=options["force"],
                    retry_errors=options["retry_errors"], grace=options["grace"], reporter=reporter,
                    lock_wait=lock_wait).run()
    return {"status": result.status, "exit_code": result.exit_code, "node": socket.gethostname()}


@dataclass
class RayRun:
    workers: list[WorkerState]
    elapsed: float

    @property
    def exit_code(self) -> int:
        codes = [w.exit_code for w in self.workers if w.exit_code != EXIT_OK]
        if not codes:
            return EXIT_OK
        return EXIT_INTERRUPTED if all(c == EXIT_INTERRUPTED for c in codes) else max(codes)


def run_on_ray(job: Job, workers: int, *, address: str | None = None, cpus_per_worker: float = 1.0,
               gpus_per_worker: float = 0.0, max_retries: int = 3, engine: str | None = None,
               force: bool = False, retry_errors: bool = False, grace: float = 60.0,
               reporter: Reporter | None = None) -> RayRun:
    ray = import_ray()
    address = address or os.environ.get("RAY_ADDRESS") or None
    if not ray.is_initialized():
        check_reachable(address)
        with _ray_quiet():
            ray.init(address=address, include_dashboard=False, log_to_driver=True, configure_logging=False)
    watch = HeadWatch(ray, address, head_patience())
    reporter = reporter or make_reporter(job.spec.progress_interval)
    board = ray.remote(num_cpus=0)(ProgressBoard).remote()
    task = ray.remote(run_shard).options(num_cpus=cpus_per_worker, num_gpus=gpus_per_worker,
                                         max_retries=max_retries, retry_exceptions=False)
    form = {"text": job.text, "base_dir": str(job.base_dir), "source": str(job.source) if job.source else None}
    options = {"engine": engine, "force": force, "retry_errors": retry_errors, "grace": grace}
    refs = {task.remote(form, i, workers, board, options): i for i in range(workers)}
    states = [WorkerState(str(Shard(i, workers)), done_before=done)
              for i, done in enumerate(rows_done(job.output_dir, workers, retry_errors))]
    start = time.monotonic()
    total, exact = InputReader.for_job(job).total_rows()
    plan = Plan(Shard(0, 1), done_before=sum(s.done_before for s in states), total=total, exact=exact,
                label=f"{workers} Ray workers", task=job.spec.task)
    reporter.start(plan)
    pending = list(refs)
    interrupted = False
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)
    try:
        while pending:
            done, pending = ray.wait(pending, num_returns=len(pending), timeout=POLL_SECONDS)
            for ref in done:
                _finished(ray, ref, states[refs[ref]])
            watch.check()
            _refresh(ray, board, states, plan, reporter, time.monotonic() - start)
    except HeadUnavailable:
        reporter.finish(_total(states, time.monotonic() - start), "stopped: the Ray head was lost")
        raise
    except KeyboardInterrupt:
        interrupted = True
        reporter.message("interrupted: asking every worker to save what is finished")
        for ref in pending:
            ray.cancel(ref)
        for ref in pending:
            _finished(ray, ref, states[refs[ref]], cancelled=True)
    elapsed = time.monotonic() - start
    _refresh(ray, board, states, plan, reporter, elapsed)
    total = _total(states, elapsed)
    status = "interrupted" if interrupted else ("complete" if all(w.exit_code == EXIT_OK for w in states)
                                                else "incomplete")
    reporter.finish(total, status)
    for w in states:
        reporter.message(worker_line(w))
    return RayRun(states, elapsed)


def check_reachable(address: str | None) -> None:
    """A head given as host:port must accept a connection: ``ray.init`` would retry one that is down
    for many minutes. (``auto``, ``local``, ``ray://`` and no address are left to Ray.)"""
    host, _, port = (address or "").rpartition(":")
    if not host or "://" in host or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_SECONDS).close()
    except OSError as e:
        raise HeadUnavailable(f"cannot reach the Ray cluster's head at {address} ({e.strerror or e}); start it "
                              "(or wait for it to restart), then run the same command again") from None


def head_patience() -> float:
    """How long the driver waits for a head that stopped answering: 10 s less than Ray's own limit
    (``RAY_gcs_rpc_server_reconnect_timeout_s``, 60 s by default), and at least half of it."""
    try:
        limit = float(os.environ.get(RAY_GCS_LIMIT, "60"))
    except ValueError:
        limit = 60.0
    return max(limit - 10.0, limit / 2)


class HeadWatch:
    """Whether the Ray cluster's head (its GCS) still answers; lost once it has not for ``patience``
    seconds. A head restarted within that time (GCS fault tolerance) is waited for."""

    def __init__(self, ray: Any, address: str | None, patience: float):
        # Ray's own client of the GCS (private; checked on Ray 2.60): where a version lacks it, no watch,
        # and Ray's own limit ends a driver whose head is gone.
        worker = getattr(getattr(getattr(ray, "_private", None), "worker", None), "global_worker", None)
        self.gcs = getattr(worker, "gcs_client", None)
        known = address not in (None, "auto", "local")
        self.address = address if known else ray.get_runtime_context().gcs_address
        self.patience = patience
        self.seen = time.monotonic()

    def check(self) -> None:
        if self.gcs is None or self._answers():
            self.seen = time.monotonic()
            return
        silent = time.monotonic() - self.seen
        if silent >= self.patience:
            raise HeadUnavailable(f"lost the Ray cluster's head at {self.address} (no answer for {silent:.0f}s); "
                                  "finished rows are saved: once the head is back, run the same command again")

    def _answers(self) -> bool:
        try:
            self.gcs.internal_kv_exists(b"batchgen", b"batchgen", timeout=HEAD_PROBE_SECONDS)
        except Exception:  # Ray's RpcError, GetTimeoutError, ...: no answer in time
            return False
        return True


@contextmanager
def _ray_quiet() -> Iterator[None]:
    """Ray's own start-up lines (e.g. "Token authentication is enabled ...") kept out of the run's
    output; its errors still show."""
    logger = logging.getLogger("ray")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def rows_done(out_dir: Location, count: int, retry_errors: bool = False) -> list[int]:
    """Rows already done for each of ``count`` shards, as each worker will find them (``recover``):
    the ids complete in any part, by the shard that owns them; with ``retry_errors``, less the
    error rows of this shard count's parts, which are generated again."""
    done = [0] * count
    if not out_dir.is_dir():
        return done
    for part in list_parts(out_dir):
        keys = format_of(part.path).keys(part.path)
        if retry_errors and part.shard.count == count:
            keys = keys.filter(pc.is_null(keys.column("error")))
        for row_id in complete_ids(keys).to_pylist():
            done[shard_of(row_id, count)] += 1
    return done


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _finished(ray: Any, ref: Any, state: WorkerState, cancelled: bool = False) -> None:
    try:
        out = ray.get(ref)
    except Exception as e:  # the task's own error (JobError: a user mistake), or Ray's
        cause = getattr(e, "cause", None) or e
        if cancelled or type(cause).__name__ in ("TaskCancelledError", "KeyboardInterrupt"):
            state.status, state.exit_code = "interrupted", EXIT_INTERRUPTED
            return
        state.status = "failed"
        state.error = str(cause).strip().splitlines()[-1] if str(cause).strip() else type(cause).__name__
        state.exit_code = getattr(cause, "exit_code", EXIT_ENGINE)
        return
    state.status, state.exit_code = out["status"], out["exit_code"]
    state.node = state.node or out["node"]


def _refresh(ray: Any, board: Any, states: list[WorkerState], plan: Plan, reporter: Reporter, elapsed: float) -> None:
    try:
        workers, messages = ray.get(board.read.remote(), timeout=HEAD_PROBE_SECONDS)
    except ray.exceptions.RayError:  # the board's node is gone or slow: progress waits, the run goes on
        return
    for i, w in workers.items():
        s = states[i]
        s.attempts, s.node = w["attempts"], w["node"]
        s.done_before = w["done_before"]
        s.snap = Snapshot(**w["snap"])
        if s.status in ("waiting", "running"):
            s.status = w["status"]
    for m in messages:
        reporter.message(m)
    plan.done_before = sum(s.done_before for s in states)
    reporter.update(_total(states, elapsed))


def _total(states: list[WorkerState], elapsed: float) -> Snapshot:
    total = Snapshot(elapsed=elapsed)
    for name in ("rows", "samples", "errors", "prompt_tokens", "output_tokens", "in_flight", "parts"):
        setattr(total, name, sum(getattr(s.snap, name) for s in states))
    for name in ("generated_tokens", "preemptions", "prefix_cache_hits", "prefix_cache_queries"):
        known = [getattr(s.snap, name) for s in states if getattr(s.snap, name) is not None]
        setattr(total, name, sum(known) if known else None)
    usage = [s.snap.kv_cache_usage for s in states if s.snap.kv_cache_usage is not None and s.status == "running"]
    total.kv_cache_usage = sum(usage) / len(usage) if usage else None
    return total


def worker_line(w: WorkerState) -> str:
    retried = f", {w.attempts - 1} retr{'y' if w.attempts == 2 else 'ies'}" if w.attempts > 1 else ""
    where = f" on {w.node}" if w.node else ""
    line = (f"  shard {w.shard:<9} {w.status}{where}: {w.snap.rows:,} rows ({w.snap.errors:,} errors), "
            f"{w.snap.output_tokens:,} output tokens, {rate(w.snap.output_tokens, w.snap.elapsed):,.1f} tok/s, "
            f"{duration(w.snap.elapsed)}{retried}")
    return f"{line}; {w.error}" if w.error else line
