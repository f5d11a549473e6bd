"""``batchgen merge OUT_DIR -o results.jsonl``: the JSONL or OpenAI batch parts of a job as one
file, in input order, each row once.

Parts are written in the order rows finish, by every shard; the merged file follows the input
instead (as the OpenAI batch output does), so it is built from an index (row id -> where its
lines are in which part) and the input's ids read in order. Only the index is held in memory;
lines are copied from the parts. The file is published whole (a renamed temp file locally, one
PUT on a bucket), so it is whole or absent, and merging again gives the same file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import IO

import pyarrow.compute as pc

from ...storage import Location, location
from ..errors import JobError
from ..inputs import InputReader
from .files import write_whole
from .formats import format_of
from .saved import load_saved_job
from .writer import complete_ids, list_parts


@dataclass
class Merged:
    path: Location
    rows: int = 0  # input rows written
    lines: int = 0
    missing: int = 0  # input rows in no part (not done yet)
    extra: int = 0  # rows in parts whose id is not in the input (any more); written at the end


def merge(out_dir: Location | Path, target: Location | Path, partial: bool = False) -> Merged:
    """Write ``target`` from the parts in ``out_dir``; refuses while rows are missing unless ``partial``."""
    out_dir, target = location(out_dir), location(target)
    job = load_saved_job(out_dir)
    index, files = _index(out_dir)
    result = Merged(target)
    order: list[str] = []
    for key in InputReader.for_job(job).ids():
        if key.id in index:
            order.append(key.id)
        else:
            result.missing += 1
    if result.missing and not partial:
        raise JobError(f"{result.missing:,} input rows of {out_dir} are not done yet; run the job again "
                       "(or merge with --partial)")
    in_input = set(order)
    extra = [row_id for row_id in index if row_id not in in_input]
    result.rows, result.extra = len(order), len(extra)
    handles: dict[int, IO[bytes]] = {}
    try:
        def write(tmp: Path) -> None:
            with open(tmp, "wb") as out:
                for row_id in [*order, *extra]:
                    for file_no, offset, length in index.pop(row_id):
                        f = handles.get(file_no) or handles.setdefault(file_no, files[file_no].open_read())
                        f.seek(offset)
                        out.write(f.read(length))
                        result.lines += 1

        target.parent.prepare_dir()
        write_whole(target, write)
    finally:
        for f in handles.values():
            f.close()
    return result


def _index(out_dir: Location) -> tuple[dict[str, list[tuple[int, int, int]]], list[Location]]:
    """Row id -> (part number, offset, length) of its lines, for ids complete in a part (the first
    part holding an id wins; ``status`` reports an id written twice)."""
    index: dict[str, list[tuple[int, int, int]]] = {}
    files: list[Location] = []
    for part in list_parts(out_dir):
        keys = format_of(part.path).keys(part.path)
        if "offset" not in keys.column_names:
            raise JobError(f"{part.path.name} is a Parquet part: merge joins jsonl and openai_batch parts; "
                           "read a Parquet output dir as one dataset (pyarrow.dataset or pandas.read_parquet)")
        done = keys.filter(pc.is_in(keys.column("id"), value_set=complete_ids(keys)))
        file_no = len(files)
        files.append(part.path)
        mine: dict[str, list[tuple[int, int, int]]] = {}
        for row_id, offset, length in zip(*(done.column(c).to_pylist() for c in ("id", "offset", "length")),
                                          strict=True):
            if row_id not in index:
                mine.setdefault(row_id, []).append((file_no, offset, length))
        index.update(mine)
    return index, files
