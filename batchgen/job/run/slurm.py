"""``batchgen slurm``: an sbatch script running a job as an array, one shard per task.

``--signal=B:TERM@120`` has Slurm send SIGTERM to the batch shell two minutes before the time
limit (and Slurm preemption sends SIGTERM too); the script passes it on to batchgen, which saves
finished rows and exits 75, and then requeues its own array task so the rest gets done.
``--requeue`` lets Slurm requeue the task itself when the node fails or the job is preempted.
"""

from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from ..errors import EXIT_INTERRUPTED, JobError
from ..spec import Job

_TIME_RE = re.compile(r"^(\d+-)?\d+(:\d{1,2}){0,2}$")


@dataclass
class SlurmOptions:
    array: int
    time: str = "04:00:00"
    gpus: int = 1
    partition: str | None = None
    account: str | None = None
    cpus_per_task: int | None = None
    mem: str | None = None
    max_parallel: int | None = None  # "%N" throttle on the array
    signal_seconds: int = 120
    python: str = sys.executable

    def check(self) -> None:
        if self.array < 1:
            raise JobError("--array must be at least 1")
        if not _TIME_RE.match(self.time):
            raise JobError(f"--time {self.time!r} is not a Slurm time such as 04:00:00 or 1-12:00:00")
        if self.gpus < 0:
            raise JobError("--gpus must be >= 0")


def logs_dir(job: Job) -> Path:
    """Where Slurm writes the tasks' logs: ``_logs`` in the output dir, or beside the job file
    when the output is in a bucket (Slurm writes local files only)."""
    out = job.output_dir
    return out.local / "_logs" if out.is_local else job.base_dir / "_logs"


def sbatch_script(job: Job, job_path: Path, opts: SlurmOptions) -> str:
    opts.check()
    n = opts.array
    logs = logs_dir(job)
    throttle = f"%{opts.max_parallel}" if opts.max_parallel else ""
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", job_path.stem)
    directives = [
        f"--job-name=batchgen-{name}",
        f"--array=0-{n - 1}{throttle}",
        f"--time={opts.time}",
    ]
    if opts.gpus:
        directives.append(f"--gpus={opts.gpus}")
    if opts.partition:
        directives.append(f"--partition={opts.partition}")
    if opts.account:
        directives.append(f"--account={opts.account}")
    if opts.cpus_per_task:
        directives.append(f"--cpus-per-task={opts.cpus_per_task}")
    if opts.mem:
        directives.append(f"--mem={opts.mem}")
    directives += [
        f"--output={logs}/%x_%A_%a.out",
        f"--error={logs}/%x_%A_%a.err",
        "--open-mode=append",
        "--requeue",
        f"--signal=B:TERM@{opts.signal_seconds}",
    ]
    head = "\n".join(f"#SBATCH {d}" for d in directives)
    q = shlex.quote
    return f"""#!/bin/bash
# Written by `batchgen slurm`: array task i runs shard i/{n} of {job_path}.
{head}

set -u
BATCHGEN=({q(opts.python)} -m batchgen)
JOB={q(str(job_path))}
SHARD="${{SLURM_ARRAY_TASK_ID}}/{n}"
# After a SIGTERM (time limit, preemption) put this task back in the queue; 0 to turn off.
REQUEUE_ON_INTERRUPT=${{REQUEUE_ON_INTERRUPT:-1}}

echo "batchgen shard $SHARD on $(hostname) at $(date -Is)"

# The signal goes to this shell only (B:), so pass it on; batchgen then stops admitting rows,
# saves what is finished and exits {EXIT_INTERRUPTED}.
"${{BATCHGEN[@]}}" run "$JOB" --shard "$SHARD" &
child=$!
term=0
trap 'term=1; kill -TERM "$child" 2>/dev/null' TERM INT
wait "$child"
rc=$?
if [ "$term" = 1 ]; then
    wait "$child"
    rc=$?
fi
echo "batchgen exited with $rc at $(date -Is)"
if [ "$rc" = {EXIT_INTERRUPTED} ] && [ "$REQUEUE_ON_INTERRUPT" = 1 ]; then
    scontrol requeue "${{SLURM_ARRAY_JOB_ID}}_${{SLURM_ARRAY_TASK_ID}}" && exit 0
fi
exit "$rc"
"""


def write_script(job: Job, job_path: Path, opts: SlurmOptions, out: Path | None = None) -> Path:
    script = sbatch_script(job, job_path, opts)
    out = out or job_path.with_suffix(".sbatch")
    try:
        logs_dir(job).mkdir(parents=True, exist_ok=True)  # Slurm does not create it
        out.write_text(script, encoding="utf-8")
        out.chmod(0o755)
    except OSError as e:
        raise JobError(f"cannot write {out}: {e}") from None
    return out
