"""How derived ids number the lines of line-numbered files (JSONL, OpenAI batch): from 1, so ``req.jsonl:4`` is
line 4, as an editor and every message count it.

Output dirs begun before this numbering held ids counted from 0 (``req.jsonl:3`` for line 4). A row's id decides
its shard and its seed, and the parts, id indexes and merge order of a dir all hold it, so a dir keeps the
numbering it began with: the saved job (``_job.json``) records it, and a dir whose saved job does not (written
before) goes on counting from 0. Nothing is renamed, no row is done twice; a new output dir counts from 1.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

SAVED_KEY = "line_ids_from"
FIRST_LINE = 1  # new output dirs
LEGACY_FIRST_LINE = 0  # output dirs whose saved job predates SAVED_KEY


def line_ids_from(saved: Mapping[str, Any] | None) -> int:
    """The first line's number in derived ids, from the output dir's saved job (None: a new dir)."""
    if saved is None:
        return FIRST_LINE
    return int(saved.get(SAVED_KEY, LEGACY_FIRST_LINE))
