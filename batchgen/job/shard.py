"""Which shard this run is, and which rows belong to it.

Rows are assigned by a stable hash of their id, not by position: a row keeps its shard when
files are added to the input or rows are appended, and every shard decides on its own rows
without knowing about the others.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass

from .errors import JobError


def stable_hash64(*parts: str | int) -> int:
    """A 64-bit hash that is the same in every process and on every machine."""
    h = hashlib.blake2b(digest_size=8)
    for p in parts:
        h.update(str(p).encode("utf-8", "surrogatepass"))
        h.update(b"\x00")
    return int.from_bytes(h.digest(), "little")


def shard_of(row_id: str, count: int) -> int:
    return 0 if count == 1 else stable_hash64(row_id) % count


def row_seed(job_seed: int, row_id: str) -> int:
    """Per-row sampling seed derived from the job seed: reproducible and independent of batching."""
    return stable_hash64("seed", job_seed, row_id) & ((1 << 63) - 1)


@dataclass(frozen=True)
class Shard:
    index: int = 0
    count: int = 1

    def __post_init__(self) -> None:
        if self.count < 1 or not 0 <= self.index < self.count:
            raise JobError(f"shard {self.index}/{self.count} is invalid: need 0 <= index < count")

    def owns(self, row_id: str) -> bool:
        return self.count == 1 or shard_of(row_id, self.count) == self.index

    @property
    def tag(self) -> str:
        """File-name form, e.g. ``00002-of-00008``."""
        return f"{self.index:05d}-of-{self.count:05d}"

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


def parse_shard(text: str) -> Shard:
    try:
        i, n = (int(x) for x in text.strip().split("/"))
    except ValueError:
        raise JobError(f"--shard must look like INDEX/COUNT, e.g. 0/4 (got {text!r})") from None
    return Shard(i, n)


def resolve_shard(
    cli: str | None,
    index: int | None,
    count: int | None,
    env: Mapping[str, str] | None = None,
) -> Shard:
    """Pick the shard: ``--shard`` wins, then the job file, then the Slurm array variables.

    ``index``/``count`` come from the job file's ``shard`` section (either may be None). The
    Slurm task index is ``SLURM_ARRAY_TASK_ID - SLURM_ARRAY_TASK_MIN`` so ``--array=1-8`` works.
    """
    if cli:
        return parse_shard(cli)
    if index is not None and count is not None:
        return Shard(index, count)
    env = os.environ if env is None else env
    task = env.get("SLURM_ARRAY_TASK_ID")
    if task is None:
        if count is not None:
            raise JobError(
                f"shard.count is {count} but no shard index: set shard.index, pass --shard i/{count}, "
                "or run inside a Slurm array job"
            )
        return Shard(0, 1)
    try:
        task_id = int(task)
        low = int(env.get("SLURM_ARRAY_TASK_MIN", "0"))
        n = int(env["SLURM_ARRAY_TASK_COUNT"]) if "SLURM_ARRAY_TASK_COUNT" in env else count
    except ValueError:
        raise JobError("SLURM_ARRAY_TASK_* variables are not integers; pass --shard i/n") from None
    if n is None:
        raise JobError("SLURM_ARRAY_TASK_COUNT is not set; pass --shard i/n")
    if count is not None and count != n:
        raise JobError(f"shard.count is {count} but the Slurm array has {n} tasks; make them agree")
    if not 0 <= task_id - low < n:
        raise JobError(
            f"Slurm array task {task_id} (min {low}, count {n}) does not map to a shard: "
            f"use a contiguous array such as --array=0-{n - 1}, or pass --shard i/n"
        )
    return Shard(task_id - low, n)
