"""Fewer Python garbage collections while a loop of engine steps runs.

Every step makes tens of thousands of short-lived Python objects (sampling records, token lists, outputs,
and in a job the rows and their results). At CPython's default first-generation threshold (700
allocations) that is a young collection every few hundred objects and a middle one every ten of those,
each walking objects that a loaded model, transformers and the job keep alive. Where the host is the
bottleneck (a small model: `scripts/bench_jobs.py`'s 20k-row case) that was ~11% of both `batchgen run`
and `LLM.generate` (scripts/PERF.md). Inside `fewer_collections()` the first threshold is 50,000; the
caller's thresholds come back after, and a collector the caller disabled stays disabled.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

YOUNG_THRESHOLD = 50_000


@contextmanager
def fewer_collections() -> Iterator[None]:
    before = gc.get_threshold()
    if 0 < before[0] < YOUNG_THRESHOLD:  # 0: the caller turned collection off
        gc.set_threshold(YOUNG_THRESHOLD, *before[1:])
    try:
        yield
    finally:
        gc.set_threshold(*before)
