"""The engine core: sequences, the paged-KV block manager, the scheduler (and the LLM engine)."""

from batchgen.engine.block_manager import BlockManager, BlockStats
from batchgen.engine.config import SchedulerConfig
from batchgen.engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput, SchedulerStats
from batchgen.engine.sequence import Sequence, SequenceGroup, SequenceStatus

__all__ = [
    "BlockManager", "BlockStats", "SchedulerConfig", "ScheduledSeq", "Scheduler", "SchedulerOutput",
    "SchedulerStats", "Sequence", "SequenceGroup", "SequenceStatus",
]
