"""Progress of a run: a rich live display on a terminal, plain periodic lines in batch logs,
and a summary at the end."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO, Any, Protocol

from ..shard import Shard


@dataclass
class Snapshot:
    """Counters of this run (rows include error rows); engine figures may be unknown (None)."""

    rows: int = 0
    samples: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0  # of the rows written
    generated_tokens: int | None = None  # made by the engine so far, rows in flight included
    in_flight: int = 0  # requests this run gave the engine and has not had back
    running: int | None = None  # of them, those in the engine's steps (at most max_num_seqs); None: not told
    parts: int = 0
    elapsed: float = 0.0
    kv_cache_usage: float | None = None
    preemptions: int | None = None
    prefix_cache_hits: int | None = None
    prefix_cache_queries: int | None = None


@dataclass
class Plan:
    """What the run set out to do: its shard, rows already done, rows in the input (if known)."""

    shard: Shard
    done_before: int = 0
    total: int | None = None  # rows of this shard in the input
    exact: bool = True
    label: str = ""  # what the lines call the run; default "shard i/n"
    task: str = "generate"  # score, embed and classify sample nothing: their figures are prompt tokens

    @property
    def name(self) -> str:
        return self.label or f"shard {self.shard}"

    @property
    def samples(self) -> bool:
        """Whether the run makes output tokens (a generation), or only reads prompts."""
        return self.task == "generate"


class Reporter(Protocol):
    def start(self, plan: Plan) -> None: ...
    def idle(self) -> None: ...
    def update(self, snap: Snapshot, force: bool = False) -> None: ...
    def message(self, text: str) -> None: ...
    def finish(self, snap: Snapshot, status: str) -> None: ...


def make_reporter(interval: float, stream: IO[str] | None = None) -> Reporter:
    stream = stream or sys.stdout
    isatty = getattr(stream, "isatty", lambda: False)
    return LiveReporter(stream) if isatty() else PlainReporter(stream, interval)


@contextmanager
def engine_steps(reporter: Reporter) -> Iterator[None]:
    """While it lasts, what the engine logs at INFO (its start-up steps: loading weights,
    the KV cache, compiling a grammar) is one line each of ``reporter``, on a terminal
    and in logs alike, so a slow start shows what it is waiting for."""
    logger = logging.getLogger("batchgen")
    handler = _ToReporter(reporter)
    level = logger.level
    logger.addHandler(handler)
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


class _ToReporter(logging.Handler):
    def __init__(self, reporter: Reporter):
        super().__init__(logging.INFO)
        self.reporter = reporter

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.reporter.message(record.getMessage())
        except Exception:  # progress must never kill a run
            self.handleError(record)


# --------------------------------------------------------------------------------- formatting


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


def rate(count: float, elapsed: float) -> float:
    return count / elapsed if elapsed > 0 else 0.0


def plural(n: int, noun: str) -> str:
    """``1 part``, ``2 parts``, ``1,000 rows``."""
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def rows_text(plan: Plan, snap: Snapshot) -> str:
    done = plan.done_before + snap.rows
    if plan.total is None:
        return f"rows {done:,}"
    approx = "" if plan.exact else "~"
    pct = 100.0 * done / plan.total if plan.total else 100.0
    return f"rows {done:,}/{approx}{plan.total:,} ({pct:.1f}%)"


def tokens_made(snap: Snapshot) -> int:
    """Output tokens generated so far: the engine's count, which grows with every step, where
    known; else those of the rows written (which grow only as rows finish)."""
    return max(snap.generated_tokens or 0, snap.output_tokens)


def token_rate(snap: Snapshot) -> float:
    return rate(tokens_made(snap), snap.elapsed)


def eta(plan: Plan, snap: Snapshot) -> float | None:
    """Seconds left: the output tokens the rows not yet written still need, at the token rate.

    A row's tokens are estimated by the rows written so far (unknown before one is); what the rows
    in flight have made counts as done, up to that estimate each. Counting tokens rather than
    finished rows keeps the estimate right while many requests are in flight, and the estimate of
    a row changes only as rows finish, so the ETA counts down steadily between them. A task that
    samples nothing (score, embed, classify) is estimated by rows written at their rate."""
    if plan.total is None:
        return None
    left = max(plan.total - plan.done_before - snap.rows, 0)
    if left == 0:
        return 0.0
    if not plan.samples:
        return left / rate(snap.rows, snap.elapsed) if snap.rows and snap.elapsed > 0 else None
    finished = snap.rows - snap.errors
    if finished <= 0 or snap.elapsed <= 0 or tokens_made(snap) == 0:
        return None
    per_row = snap.output_tokens / finished
    in_flight_made = tokens_made(snap) - snap.output_tokens
    needed = left * per_row - min(in_flight_made, snap.in_flight * per_row)
    return max(needed, 0.0) / token_rate(snap)


def rate_text(plan: Plan, snap: Snapshot) -> str:
    """Output tokens a second, or prompt tokens a second for a task that samples nothing."""
    if plan.samples:
        return f"{token_rate(snap):,.1f} out tok/s"
    return f"{rate(snap.prompt_tokens, snap.elapsed):,.1f} prompt tok/s"


def flight_text(snap: Snapshot) -> str:
    """The requests in the engine's steps (never above max_num_seqs) and those queued behind them."""
    if snap.running is None:
        return f"in flight {snap.in_flight}"
    running = min(snap.running, snap.in_flight)
    return f"running {running} | queued {snap.in_flight - running}"


def status_line(plan: Plan, snap: Snapshot) -> str:
    parts = [plan.name, rows_text(plan, snap)]
    if snap.errors:
        parts.append(f"errors {snap.errors:,}")
    parts.append(rate_text(plan, snap))
    if snap.kv_cache_usage is not None:
        parts.append(f"kv {100 * snap.kv_cache_usage:.0f}%")
    if snap.preemptions is not None:
        parts.append(f"preemptions {snap.preemptions:,}")
    parts.append(flight_text(snap))
    parts.append(f"elapsed {duration(snap.elapsed)}")
    if plan.total is not None:
        parts.append(f"eta {duration(eta(plan, snap))}")
    return " | ".join(parts)


def summary(plan: Plan, snap: Snapshot, status: str) -> str:
    hit = ("n/a" if not snap.prefix_cache_queries
           else f"{100.0 * (snap.prefix_cache_hits or 0) / snap.prefix_cache_queries:.1f}%")
    samples = f"{plural(snap.samples, 'sample')}, " if plan.samples else ""
    preemptions = plural(snap.preemptions, "preemption") if snap.preemptions is not None else "n/a preemptions"
    return "\n".join([
        f"batchgen: {plan.name} {status}",
        f"  rows         {snap.rows:,} this run ({plural(snap.errors, 'error')}), {samples}"
        f"{plural(snap.parts, 'part')} written; {plan.done_before:,} done before",
        *_token_lines(plan, snap),
        f"  engine       {preemptions}, prefix cache hit rate {hit}",
    ])


def _token_lines(plan: Plan, snap: Snapshot) -> list[str]:
    """The summary's tokens and their rates: a generation's prompt and output tokens, or the prompt
    tokens alone of a task that samples nothing (a score row's completion is part of its prompt)."""
    if not plan.samples:
        return [f"  tokens       {snap.prompt_tokens:,} prompt (task {plan.task} makes no output tokens)",
                f"  wall time    {duration(snap.elapsed)}; {rate(snap.prompt_tokens, snap.elapsed):,.1f} prompt tok/s"]
    tokens = snap.prompt_tokens + snap.output_tokens
    return [f"  tokens       {snap.prompt_tokens:,} prompt, {snap.output_tokens:,} output",
            f"  wall time    {duration(snap.elapsed)}; {rate(snap.output_tokens, snap.elapsed):,.1f} output tok/s, "
            f"{rate(tokens, snap.elapsed):,.1f} tok/s in all"]


# ---------------------------------------------------------------------------------- reporters


class PlainReporter:
    """One line every ``interval`` seconds, for logs (stdout not a terminal)."""

    def __init__(self, stream: IO[str], interval: float):
        self.stream = stream
        self.interval = interval
        self.plan = Plan(Shard())
        self._next = 0.0

    def _print(self, text: str) -> None:
        print(f"[batchgen {time.strftime('%H:%M:%S')}] {text}", file=self.stream, flush=True)

    def idle(self) -> None:
        print(nothing_to_do(self.plan), file=self.stream, flush=True)

    def start(self, plan: Plan) -> None:
        self.plan = plan
        self._next = time.monotonic() + self.interval
        total = "unknown" if plan.total is None else f"{'' if plan.exact else '~'}{plan.total:,}"
        self._print(f"{plan.name}: {plan.done_before:,} rows done before, {total} rows in input")

    def update(self, snap: Snapshot, force: bool = False) -> None:
        now = time.monotonic()
        if force or now >= self._next:
            self._next = now + self.interval
            self._print(status_line(self.plan, snap))

    def message(self, text: str) -> None:
        self._print(text)

    def finish(self, snap: Snapshot, status: str) -> None:
        print(summary(self.plan, snap, status), file=self.stream, flush=True)


def nothing_to_do(plan: Plan) -> str:
    return f"batchgen: {plan.name} has nothing to do: all {plan.done_before:,} rows found are done"


class LiveReporter:
    """A rich live panel: bar of rows done, token rate, KV cache use, preemptions, ETA."""

    def __init__(self, stream: IO[str], console: Any = None):
        from rich.console import Console

        self.console = console or Console(file=stream)
        self.plan = Plan(Shard())
        self._live: Any = None
        self._last = 0.0

    def idle(self) -> None:
        self.finish(Snapshot(), "")
        self.console.print(nothing_to_do(self.plan), markup=False, highlight=False)

    def start(self, plan: Plan) -> None:
        from rich.live import Live

        self.plan = plan
        self._live = Live(self._render(Snapshot()), console=self.console, refresh_per_second=4,
                          transient=False)
        self._live.start()

    def _render(self, snap: Snapshot) -> Any:
        """Three lines, each within the terminal's width (cut with an ellipsis, never wrapped): the bar
        beside the rows done, the engine's figures, errors and times."""
        from rich.console import Group
        from rich.progress_bar import ProgressBar
        from rich.table import Table
        from rich.text import Text

        done = self.plan.done_before + snap.rows
        total = self.plan.total
        rows = rows_text(self.plan, snap)
        grid = Table.grid(padding=(0, 1))
        bar = max(10, min(40, self.console.width - len(rows) - 1))
        grid.add_row(ProgressBar(total=float(total) if total else None, completed=float(done), width=bar),
                     Text(rows, no_wrap=True, overflow="ellipsis"))
        engine = [rate_text(self.plan, snap)]
        if snap.kv_cache_usage is not None:
            engine.append(f"KV cache {100 * snap.kv_cache_usage:.0f}%")
        if snap.preemptions is not None:
            engine.append(f"preemptions {snap.preemptions:,}")
        engine.append(flight_text(snap))
        timing = f"errors {snap.errors:,} | elapsed {duration(snap.elapsed)}"
        if total is not None:
            timing += f" | ETA {duration(eta(self.plan, snap))}"
        return Group(grid, *(Text(line, no_wrap=True, overflow="ellipsis") for line in (" | ".join(engine), timing)))

    def update(self, snap: Snapshot, force: bool = False) -> None:
        now = time.monotonic()
        if self._live is not None and (force or now - self._last >= 0.25):
            self._last = now
            self._live.update(self._render(snap))

    def message(self, text: str) -> None:
        self.console.print(text, markup=False, highlight=False)

    def finish(self, snap: Snapshot, status: str) -> None:
        if self._live is not None:
            self._live.update(self._render(snap))
            self._live.stop()
            self._live = None
        if status:
            self.console.print(summary(self.plan, snap, status), markup=False, highlight=False)
