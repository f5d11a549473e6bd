"""The guides from the command line: ``batchgen docs`` lists them, ``batchgen docs TOPIC`` prints one.

They are README.md and docs/*.md. A wheel ships them in ``batchgen/docs/`` (setup.py's build_py copies
them there); in a clone (an editable install) they are read where they are written, beside the package.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path

PACKAGED = Path(__file__).resolve().parent / "docs"  # an installed wheel's copy
CLONE = Path(__file__).resolve().parent.parent  # a clone: README.md and docs/ beside the package


def guide_files() -> dict[str, Path]:
    """Each guide by its topic (``cli`` for docs/cli.md, ``readme`` for README.md), in name order."""
    if PACKAGED.is_dir():
        files = sorted(PACKAGED.glob("*.md"))
    else:
        files = [CLONE / "README.md", *sorted((CLONE / "docs").glob("*.md"))]
    return {path.stem.lower(): path for path in files if path.is_file()}


def title(path: Path) -> str:
    """A guide's first heading."""
    found = re.search(r"^#\s+(.+)$", path.read_text(encoding="utf-8"), re.M)
    return found[1].strip() if found else path.stem


def guide_text(topic: str) -> str:
    """The guide of ``topic`` as written; ``LookupError`` naming the closest topic when there is none."""
    files = guide_files()
    path = files.get(topic.lower().removesuffix(".md"))
    if path is None:
        close = difflib.get_close_matches(topic.lower(), list(files), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise LookupError(f"no guide {topic!r}{hint}; `batchgen docs` lists them")
    return path.read_text(encoding="utf-8")
