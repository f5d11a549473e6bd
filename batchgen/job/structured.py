"""Structured outputs in job files: schema files, per-row constraint columns, the ``parsed`` column.

``sampling.structured_outputs`` takes one of ``json`` (a schema inline, as a mapping or JSON text,
or the path of a ``.json`` file relative to the job file), ``regex``, ``choice``, ``grammar`` or
``json_object: true``. A row's own constraint comes from a column named in ``sampling.overrides``
under ``structured_outputs.<kind>`` (its value: a schema as JSON text or an object, a regex, a
list of choices, a grammar), or under ``structured_outputs`` (a whole constraint, ``{"json": ...}``),
and replaces the job's for that row.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..structured.params import KINDS
from .errors import Problem

FIELD = "structured_outputs"
OVERRIDE_KEYS = tuple(f"{FIELD}.{kind}" for kind in KINDS if kind != "json_object")


def resolve_schema_file(raw: dict[str, Any], base_dir: Path) -> list[Problem]:
    """Replaces a schema path at ``sampling.structured_outputs.json`` by the file's schema, in place.

    A file that cannot be read is one problem, and the constraint is then taken out of ``raw``:
    left in, its path would be checked again as inline JSON and reported a second time."""
    sampling = raw.get("sampling")
    constraint = sampling.get(FIELD) if isinstance(sampling, dict) else None
    schema = constraint.get("json") if isinstance(constraint, dict) else None
    if not isinstance(schema, str) or schema.lstrip().startswith("{"):
        return []
    path = Path(schema).expanduser()
    path = path if path.is_absolute() else base_dir / path
    problem = _schema_file_problem(path, constraint)
    if problem is None:
        return []
    del sampling[FIELD]
    return [Problem(f"sampling.{FIELD}.json", problem)]


def _schema_file_problem(path: Path, constraint: dict[str, Any]) -> str | None:
    """Reads the schema file into ``constraint["json"]``; what is wrong with it, if anything."""
    try:
        constraint["json"] = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return f"no schema file at {path} (give a path to a .json file or the schema inline)"
    except (OSError, UnicodeDecodeError) as e:
        return f"cannot read {path}: {e}"
    except json.JSONDecodeError as e:
        return f"{path} is not valid JSON: {e}"
    return None


def row_constraint(overrides: dict[str, Any]) -> dict[str, Any]:
    """A row's override values with its constraint columns gathered into one ``structured_outputs``
    mapping (a choice list or schema object may come as JSON text)."""
    out = {k: v for k, v in overrides.items() if k not in OVERRIDE_KEYS}
    if isinstance(out.get(FIELD), str):  # the whole constraint, {"json": ...}, as JSON text
        out[FIELD] = _json_or_text(out[FIELD])
    given = {k.split(".", 1)[1]: v for k, v in overrides.items() if k in OVERRIDE_KEYS}
    if given:
        if isinstance(given.get("choice"), str):
            given["choice"] = _json_or_text(given["choice"])
        out[FIELD] = given
    return out


def _json_or_text(text: str) -> Any:
    """JSON text decoded; anything else as it is, to be refused with its column's name later."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parsed_json(text: str | None, finish_reason: str | None, valid: bool | None) -> str | None:
    """The output parsed as JSON and written back compactly; None when max_tokens cut it, when it
    is not a valid string of its constraint, or when it is not JSON."""
    if text is None or finish_reason != "stop" or valid is False:
        return None
    try:
        return json.dumps(json.loads(text), ensure_ascii=False, separators=(",", ":"))
    except json.JSONDecodeError:
        return None
