"""StructuredOutputsParams: the constraint of one request, in the shape vLLM users know."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, fields
from functools import lru_cache
from typing import Any

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Set exactly one field. ``json``: a JSON schema (dict or JSON text); ``json_object``: any
    JSON object; ``choice``: one of the given strings, verbatim; ``grammar``: EBNF (GBNF) text
    whose start rule is ``root``; ``regex``: the whole output matches it."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [f.name for f in fields(self) if getattr(self, f.name) not in (None, False)]
        if len(given) != 1:
            what = f"got {', '.join(given)}" if given else "got none"
            raise ValueError(f"structured_outputs: set exactly one of {', '.join(KINDS)} ({what})")
        if self.choice is not None:
            choice = self.choice
            if not isinstance(choice, (list, tuple)) or not choice or any(
                    not isinstance(c, str) or not c for c in choice):
                raise ValueError(f"structured_outputs.choice: must be a non-empty list of non-empty strings "
                                 f"(got {choice!r})")
            object.__setattr__(self, "choice", list(choice))
        if self.json_object not in (None, True):
            raise ValueError(f"structured_outputs.json_object: must be true (got {self.json_object!r})")
        if self.kind in ("regex", "grammar") and not isinstance(getattr(self, self.kind), str):
            raise ValueError(f"structured_outputs.{self.kind}: must be a string (got {getattr(self, self.kind)!r})")
        grammar_of(self.kind, self.key)  # a bad schema, regex or grammar is refused here, once per text

    @property
    def kind(self) -> str:
        return next(name for name in KINDS if getattr(self, name) not in (None, False))

    @property
    def key(self) -> str:
        """The constraint's canonical text: equal constraints (a schema as dict or as text) share it."""
        value = getattr(self, self.kind)
        if self.kind == "json":
            return canonical_schema(value)
        if self.kind == "choice":
            return json.dumps(value, ensure_ascii=False)
        if self.kind == "json_object":
            return ""
        return value

    @classmethod
    def coerce(cls, value: Any) -> StructuredOutputsParams | None:
        """From a mapping (job files, per-row columns) or an instance; None stays None."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"structured_outputs: expected a mapping such as {{json: SCHEMA}}, "
                             f"got {type(value).__name__}")
        unknown = sorted(set(value) - set(KINDS))
        if unknown:
            raise ValueError(f"structured_outputs.{unknown[0]}: unknown field (valid: {', '.join(KINDS)})")
        return cls(**value)


def canonical_schema(schema: dict[str, Any] | str) -> str:
    """Compact JSON text of a schema; key order is kept (it is the order of the generated fields)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"structured_outputs.json: not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise ValueError(f"structured_outputs.json: a JSON schema must be an object, got {type(schema).__name__}")
    try:
        return json.dumps(schema, ensure_ascii=False, separators=(",", ":"))
    except (TypeError, ValueError) as e:
        raise ValueError(f"structured_outputs.json: not JSON-serialisable: {e}") from None


def choice_grammar(choices: list[str]) -> str:
    """EBNF alternation of the literal strings (JSON string escapes are EBNF string escapes)."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


@lru_cache(maxsize=1024)
def grammar_of(kind: str, key: str) -> Any:
    """The xgrammar Grammar of a constraint (tokenizer-independent: parsing only), cached by text.
    Raises ValueError("structured_outputs.<kind>: why") for a constraint xgrammar refuses."""
    import xgrammar as xgr

    try:
        if kind == "json":
            return xgr.Grammar.from_json_schema(key)
        if kind == "regex":
            return xgr.Grammar.from_regex(key)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(choice_grammar(json.loads(key)))
        if kind == "grammar":
            return xgr.Grammar.from_ebnf(key)
        return xgr.Grammar.from_json_schema('{"type": "object"}')  # any object (the builtin grammar takes arrays too)
    except (RuntimeError, ValueError, TypeError) as e:
        raise ValueError(f"structured_outputs.{kind}: {xgrammar_message(e)}") from None


def xgrammar_message(error: Exception) -> str:
    """The first line of an xgrammar error, without its time stamp and C++ source location."""
    text = str(error).strip()
    return _XGRAMMAR_PREFIX.sub("", text).splitlines()[0] if text else type(error).__name__
