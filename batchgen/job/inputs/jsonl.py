"""JSONL input (also the line format of OpenAI batch request files), read line by line, so one
malformed line becomes an error row instead of a failed job.

Rows are numbered by physical line from 0 (messages say "line N" from 1), blank lines included,
so ids derived from the number stay put when lines are appended. A last line without its
newline may still be being written: it is read only when it is already complete JSON.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from ..errors import JobError
from .kinds import kind_of
from .rows import InputFile, Record
from .streams import open_decompressed
from .values import type_name

INFER_LINES = 1000  # lines looked at for the columns of a file and the kinds of carried columns


class JsonlSource:
    strict = False  # any line may lack any column: it is null in that row

    def __init__(self, f: InputFile, warnings: list[str]):
        """``warnings`` collects notes such as a skipped incomplete last line."""
        self.file = f
        self.warnings = warnings

    def column_names(self) -> set[str] | None:
        """Every key of the first objects (None: no line yet). A file none of whose first lines
        is a JSON object is surely not JSONL (a CSV file, say): ``JobError``, rather than as
        many error rows as it has lines."""
        names: set[str] | None = None
        first_error: str | None = None
        seen = 0
        for seen, record in enumerate(self.records(), 1):
            if record.values is not None:
                names = (names or set()) | set(record.values)
            elif first_error is None:
                first_error = f"line {record.index + 1}: {record.error}"
            if seen >= INFER_LINES:
                break
        if names is not None or not seen:
            return names
        raise JobError(f"{self.file.name} is not JSONL: none of its first {seen:,} lines is a JSON object "
                       f"({first_error})")

    def count(self) -> tuple[int | None, bool]:
        """The newline count (blank lines and a last line without newline blur it) of a local
        file that is not gzipped: nothing is read twice from a bucket, nor unzipped twice, for a
        progress bar."""
        if not self.file.path.is_local or self.file.path.suffix == ".gz":
            return None, False
        with open_decompressed(self.file) as fh:
            return sum(chunk.count(b"\n") for chunk in iter(lambda: fh.read(1 << 20), b"")), False

    def records(self, columns: list[str] | None = None, parse: bool = True) -> Iterator[Record]:
        """Every object's keys, whatever ``columns`` says (a line is parsed whole anyway)."""
        with open_decompressed(self.file) as fh:
            pending: tuple[int, bytes] | None = None
            for index, line in enumerate(fh):
                if pending is not None:
                    yield self._record(*pending, parse)
                pending = None
                if not line.strip():
                    continue
                if line.endswith(b"\n"):
                    yield self._record(index, line, parse)
                else:
                    pending = (index, line)
            if pending is not None:
                if parse_line(pending[1])[1] is None:
                    yield self._record(*pending, parse)
                else:
                    note = (f"{self.file.name} line {pending[0] + 1}: incomplete last line skipped "
                            "(no newline yet); it is read again next run")
                    if note not in self.warnings:
                        self.warnings.append(note)

    def _record(self, index: int, line: bytes, parse: bool) -> Record:
        if not parse:
            return Record(index, None)
        return Record(index, *parse_line(line))

    def objects(self, limit: int) -> Iterator[dict[str, Any]]:
        """The well-formed objects among the first ``limit`` lines."""
        for seen, record in enumerate(self.records(), 1):
            if record.values is not None:
                yield record.values
            if seen >= limit:
                return


def infer_kinds(sources: list[JsonlSource], columns: list[str]) -> dict[str, str]:
    """Each column's kind: that of its first non-null value within the first lines of the files
    ("json" when there is none)."""
    kinds: dict[str, str] = {}
    budget = INFER_LINES
    for source in sources:
        for obj in source.objects(budget):
            budget -= 1
            for c in columns:
                if c not in kinds and obj.get(c) is not None:
                    kinds[c] = kind_of(obj[c])
        if budget <= 0 or len(kinds) == len(columns):
            break
    return {c: kinds.get(c, "json") for c in columns}


def parse_line(line: bytes) -> tuple[dict[str, Any] | None, str | None]:
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as e:
        return None, f"invalid UTF-8 at byte {e.start} of the line"
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return None, f"malformed JSON: {e.msg} (column {e.colno})"
    if not isinstance(obj, dict):
        return None, f"expected a JSON object, got {type_name(obj)}"
    return obj, None
