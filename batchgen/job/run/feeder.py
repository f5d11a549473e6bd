"""Rows on their way to the engine: read and prepared (requests built, prompts encoded) a chunk at a
time, so that the tokenizer encodes a chunk's prompts in one call instead of one call per row.

``background``: the chunks are read and prepared on a thread of their own, a few ahead of the engine
loop, so that reading, chat templating and tokenizing overlap the engine's steps instead of running
between them. Exactly-once is untouched: a row is done when its part exists, so rows read ahead and
never admitted are simply read again by the next run.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from ..inputs import Row
from ..requests import EngineRequest

CHUNK_ROWS = 128  # rows prepared together (one tokenizer call for their prompts)
IMAGE_CHUNK_ROWS = 8  # the same for rows with images: their decoding is what takes the time
CHUNKS_AHEAD = 4  # background: chunks prepared before the loop asks for them
STOP_WAIT_SECONDS = 10.0  # close(): how long the background thread may take to finish its chunk


@dataclass
class PreparedRow:
    """A row and its engine requests, or the error it is recorded with instead."""

    row: Row
    requests: list[EngineRequest] = field(default_factory=list)
    error: str | None = None
    image_bytes: int = 0  # what the decoded images in its requests hold


Prepare = Callable[[list[Row]], list[PreparedRow]]


@dataclass
class _Chunk:
    rows: list[PreparedRow]
    error: BaseException | None = None  # what reading (after ``rows``) or preparing raised
    last: bool = False  # the input ends here


class RowFeeder:
    def __init__(self, rows: Iterator[Row], prepare: Prepare, *, chunk: int = CHUNK_ROWS,
                 background: bool = False, ahead_bytes: int | None = None):
        """``ahead_bytes`` (background): decoded images prepared and not taken yet, at most about this
        much (one chunk more when none is ahead)."""
        self._rows = rows
        self._prepare = prepare
        self._chunk = chunk
        self._ahead_limit = ahead_bytes
        self._ahead = 0  # image bytes of the rows prepared and not taken
        self._room = threading.Condition()
        self._ready: deque[PreparedRow] = deque()
        self._ended = False  # no more chunks will come
        self._error: BaseException | None = None  # what ended them, raised after the rows before it
        self._queue: queue.Queue[_Chunk] | None = None
        self._closing = threading.Event()
        if background:
            self._queue = queue.Queue(CHUNKS_AHEAD)
            self._thread = threading.Thread(target=self._fill, name="batchgen-rows", daemon=True)
            self._thread.start()

    def take(self, n: int, wait: bool = True, max_bytes: int | None = None) -> list[PreparedRow]:
        """Up to ``n`` prepared rows, in input order. In the background, only the chunks ready now, unless
        ``wait`` and none is: then the next one, waited for. ``max_bytes``: the rows' decoded images hold no
        more than this (None: no bound, and at least the first row). Raises what reading or preparing
        raised once the rows before it are taken."""
        while len(self._ready) < n and not self._ended:
            chunk = self._next_chunk(block=wait and not self._ready)
            if chunk is None:
                break
            self._ready.extend(chunk.rows)
            self._ended, self._error = chunk.last, chunk.error
        if not self._ready and self._error is not None:
            error, self._error = self._error, None
            raise error
        taken: list[PreparedRow] = []
        size = 0
        while self._ready and len(taken) < n:
            size += self._ready[0].image_bytes
            if max_bytes is not None and size > max_bytes:
                break
            taken.append(self._ready.popleft())
        self._release(sum(p.image_bytes for p in taken))
        return taken

    def _release(self, nbytes: int) -> None:
        if nbytes:
            with self._room:
                self._ahead -= nbytes
                self._room.notify_all()

    def _wait_for_room(self, nbytes: int) -> None:
        """Background: holds a prepared chunk back while the images ahead are over ``ahead_bytes``."""
        with self._room:
            while (self._ahead_limit is not None and self._ahead > 0 and self._ahead + nbytes > self._ahead_limit
                   and not self._closing.is_set()):
                self._room.wait(0.1)
            self._ahead += nbytes

    @property
    def done(self) -> bool:
        """Every row taken (or the input failed, and that was raised)."""
        return self._ended and not self._ready and self._error is None

    def close(self) -> None:
        """Stops the background thread, waiting up to STOP_WAIT_SECONDS for the chunk it is reading or preparing:
        a daemon thread still inside the tokenizer's native code when the interpreter exits can end the process
        in std::terminate. One stuck longer in a read (a stalled bucket) is left behind: it is a daemon."""
        self._closing.set()
        if self._queue is None:
            return
        try:
            while True:
                self._queue.get_nowait()
        except queue.Empty:
            pass
        self._thread.join(STOP_WAIT_SECONDS)

    def _next_chunk(self, block: bool) -> _Chunk | None:
        """The next chunk; None when none is ready without blocking."""
        if self._queue is None:
            return self._read_chunk()
        try:
            return self._queue.get(block=block)
        except queue.Empty:
            return None

    def _read_chunk(self) -> _Chunk:
        rows: list[Row] = []
        error: Exception | None = None
        try:
            rows.extend(itertools.islice(self._rows, self._chunk))  # keeps the rows read before an error
        except Exception as e:
            error = e
        return _Chunk(self._prepare(rows) if rows else [], error, error is not None or len(rows) < self._chunk)

    def _fill(self) -> None:
        assert self._queue is not None
        last = False
        while not last and not self._closing.is_set():
            try:
                chunk = self._read_chunk()
            except BaseException as e:  # preparing failed: the loop raises it
                chunk = _Chunk([], e, last=True)
            last = chunk.last
            self._wait_for_room(sum(p.image_bytes for p in chunk.rows))
            while not self._closing.is_set():
                try:
                    self._queue.put(chunk, timeout=0.1)
                    break
                except queue.Full:
                    continue
