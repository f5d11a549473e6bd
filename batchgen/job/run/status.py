"""``batchgen status OUTPUT_DIR``: rows done, errors and rows still missing, per shard.

Needs only the output dir: the run saved its job there (``_job.json``), which tells where the
input is, so missing rows are counted by reading the input ids (only the id column of Parquet, columnar).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from ...storage import Location, location
from ...storage.locks import LockState, lock_states
from ..ids import DoneIds
from ..inputs import InputReader
from ..inputs.reader import repeated_ids
from ..outputs.formats import UnreadablePart, format_of
from ..outputs.saved import load_saved_job, read_saved
from ..outputs.writer import list_parts, part_ids, summarize
from ..shard import Shard, shard_of
from .lock import LOCK_DIR, LOCK_RE

_SHOWN_DUPLICATES = 5


@dataclass
class ShardStatus:
    shard: Shard
    parts: int = 0
    rows: int = 0
    errors: int = 0
    input_rows: int | None = None
    missing: int | None = None
    running: bool = False
    started: bool = False
    lease: str | None = None  # a held bucket lease, where "running" would say too much (LockState.note)

    @property
    def state(self) -> str:
        if self.running:
            return self.lease or "running"
        if self.missing == 0:
            return "done"
        return "incomplete" if self.started else "not started"


@dataclass
class Report:
    out_dir: Location
    config_hash: str
    count: int
    shards: list[ShardStatus] = field(default_factory=list)
    other_parts: int = 0  # parts written under another shard count
    written_twice: int = 0  # ids complete again in another part (should never happen)
    duplicates: int = 0  # input rows repeating the id of an earlier row
    duplicate_examples: list[str] = field(default_factory=list)  # the first few, as error messages
    input_error: str | None = None
    corrupt: list[str] = field(default_factory=list)  # parts that are not whole, one line each


def collect(out_dir: Location | Path, with_input: bool = True, verify: bool = False) -> Report:
    """What `status` shows; ``verify`` (``status --verify``) reads every part whole and checks it."""
    out_dir = location(out_dir)
    job = load_saved_job(out_dir)
    saved = read_saved(out_dir) or {}
    parts = list_parts(out_dir)
    lock_shards: dict[Shard, LockState] = {}  # oldest lock first
    for state in lock_states(out_dir / LOCK_DIR):
        m = LOCK_RE.match(state.name)
        if m:
            lock_shards[Shard(int(m.group(1)), int(m.group(2)))] = state
    # The shard count of the newest run decides how missing rows are split.
    count = (list(lock_shards)[-1].count if lock_shards
             else max((pt.shard.count for pt in parts), default=1))
    report = Report(out_dir, str(saved.get("config_hash", "?")), count)
    per = {i: ShardStatus(Shard(i, count)) for i in range(count)}
    done = DoneIds()
    for part in parts:
        try:
            index = summarize(part.path, part.info.size)[1]
            if verify:
                format_of(part.path).verify(part.path)
        except UnreadablePart as e:
            report.corrupt.append(str(e))
            continue
        done.add_part(None, partial(part_ids, part.path), index.hashes)
        if part.shard.count != count:
            report.other_parts += 1
            continue
        st = per[part.shard.index]
        st.parts += 1
        st.rows += len(index)
        st.errors += index.errors
        st.started = True
    report.written_twice = done.twice
    for sh, state in lock_shards.items():
        if sh.count == count:
            per[sh.index].started = True
            per[sh.index].running = state.held
            per[sh.index].lease = state.note
    if with_input:
        try:
            reader = InputReader.for_job(job)
            totals = np.zeros(count, dtype=np.int64)
            missing = np.zeros(count, dtype=np.int64)
            for batch in reader.id_batches():
                not_done = ~done.contains(batch.ids, batch.hashes)
                shards = (np.zeros(len(batch.ids), dtype=np.int64) if count == 1 else
                          np.fromiter((shard_of(i, count) for i in batch.owners.to_pylist()), np.int64, len(batch.ids)))
                totals += np.bincount(shards, minlength=count)
                missing += np.bincount(shards[not_done], minlength=count)
                report.duplicates += len(batch.duplicates)
                report.duplicate_examples += list(batch.duplicates.values())[:_SHOWN_DUPLICATES - len(
                    report.duplicate_examples)]
            for i, st in per.items():
                st.input_rows, st.missing = int(totals[i]), int(missing[i])
        except Exception as e:  # the input may have moved; still show what is done
            report.input_error = str(e).splitlines()[0]
    report.shards = list(per.values())
    return report


STATUS_SCHEMA = 1  # the version of ``as_json``'s layout (docs/cli.md); bumped on a change that breaks a reader


def as_json(report: Report) -> dict[str, Any]:
    """The report for scripts (``status --json``), in the layout docs/cli.md documents."""
    shards = [{"shard": str(st.shard), "index": st.shard.index, "count": st.shard.count, "parts": st.parts,
               "rows": st.rows, "errors": st.errors, "input_rows": st.input_rows, "missing": st.missing,
               "state": st.state} for st in report.shards]
    known = [st.missing for st in report.shards if st.missing is not None]
    return {
        "schema": STATUS_SCHEMA, "output_dir": str(report.out_dir), "config_hash": report.config_hash,
        "shard_count": report.count, "shards": shards,
        "total": {"parts": sum(s["parts"] for s in shards), "rows": sum(s["rows"] for s in shards),
                  "errors": sum(s["errors"] for s in shards),
                  "missing": sum(known) if len(known) == len(shards) else None},
        "other_parts": report.other_parts, "written_twice": report.written_twice,
        "duplicates": report.duplicates, "duplicate_examples": report.duplicate_examples,
        "input_error": report.input_error, "corrupt_parts": report.corrupt,
    }


def render(report: Report) -> str:
    lines = [f"output  {report.out_dir}", f"config  {report.config_hash}", ""]
    lines.append(f"{'shard':<12}{'parts':>7}{'rows done':>12}{'errors':>9}{'missing':>10}  state")
    tot = ShardStatus(Shard())
    for st in report.shards:
        miss = "?" if st.missing is None else f"{st.missing:,}"
        lines.append(f"{str(st.shard):<12}{st.parts:>7,}{st.rows:>12,}{st.errors:>9,}{miss:>10}  {st.state}")
        tot.parts += st.parts
        tot.rows += st.rows
        tot.errors += st.errors
    known = [st.missing for st in report.shards if st.missing is not None]
    miss = f"{sum(known):,}" if len(known) == len(report.shards) else "?"
    lines.append(f"{'total':<12}{tot.parts:>7,}{tot.rows:>12,}{tot.errors:>9,}{miss:>10}")
    if report.other_parts:
        lines.append(f"note: {report.other_parts} parts were written with another shard count "
                     "(their rows count as done)")
    if report.duplicates:
        lines.append(f"warning: {repeated_ids(report.duplicates)}:")
        lines += [f"  {d}" for d in report.duplicate_examples]
        if report.duplicates > len(report.duplicate_examples):
            lines.append(f"  ... and {report.duplicates - len(report.duplicate_examples):,} more")
    if report.written_twice:
        lines.append(f"warning: {report.written_twice} ids appear in more than one part")
    lines += [f"warning: {c}; the next run of its shard sets it aside and generates its rows again"
              for c in report.corrupt]
    if report.input_error:
        lines.append(f"note: cannot read the input to count missing rows: {report.input_error}")
    return "\n".join(lines)
