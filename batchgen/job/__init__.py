"""The job layer: job files, streaming input, Parquet parts, resumable runs, status, Slurm.

Only the engine's public API is used (``add_request``/``step``/``stats``), through a factory.
"""

from .errors import EXIT_ENGINE, EXIT_ERROR, EXIT_INTERRUPTED, EXIT_LOCKED, EXIT_OK, JobError, JobInvalid
from .run.runner import Runner, RunResult, StopFlag
from .shard import Shard
from .spec import Job, JobSpec, load_job
from .validate import validate_job_file

__all__ = [
    "EXIT_ENGINE", "EXIT_ERROR", "EXIT_INTERRUPTED", "EXIT_LOCKED", "EXIT_OK", "Job", "JobError",
    "JobInvalid", "JobSpec", "RunResult", "Runner", "Shard", "StopFlag", "load_job", "validate_job_file",
]
