"""The engine core: sequences, the paged-KV block manager, the scheduler (and the LLM engine).

Its names are imported on first use, so that the job layer's torch-free pieces (``gc_pacing``) do not
bring torch in: ``batchgen status``, ``merge`` and ``validate`` start in a fraction of the time.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "BlockManager": "block_manager", "BlockStats": "block_manager", "SchedulerConfig": "config",
    "ScheduledSeq": "scheduler", "Scheduler": "scheduler", "SchedulerOutput": "scheduler",
    "SchedulerStats": "scheduler", "Sequence": "sequence", "SequenceGroup": "sequence",
    "SequenceStatus": "sequence",
}
__all__ = list(_HOMES)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'batchgen.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(f"batchgen.engine.{_HOMES[name]}"), name)
