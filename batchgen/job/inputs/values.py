"""Checks of a row's values, the same for every format: the prompt, chat messages, text.

Each check returns why a value is refused (the reader prefixes the file, row and field) or None.
"""

from __future__ import annotations

from typing import Any

from .image_values import clean_content, content_problem
from .rows import BadValue, decode, type_name


def encodable(s: str) -> bool:
    """False for text with lone surrogates (JSON can carry them; no output file can)."""
    try:
        s.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def check_prompt(v: Any, what: str = "prompt") -> str | None:
    """A text or token ids (``what``: the name of the value in the message)."""
    if v is None:
        return "missing or null"
    if isinstance(v, BadValue):
        return v.why
    if isinstance(v, str):
        if not v.strip():
            return f"empty {what}"
        return None if encodable(v) else "not valid Unicode (lone surrogate)"
    if isinstance(v, list) and v and all(type(t) is int and t >= 0 for t in v):
        return None
    return f"expected a string or a non-empty list of token ids, got {type_name(v)}"


CHAT_AS_PROMPT = "chat messages in input.prompt_column"


def chat_as_prompt(v: Any, column: str) -> str | None:
    """The hint for a prompt column holding chat messages (a list of objects with a role), or None."""
    if not (isinstance(v, list) and v and all(isinstance(m, dict) and "role" in m for m in v)):
        return None
    return f"{CHAT_AS_PROMPT}; read this column with input.messages_column: {column} instead"


def check_messages(v: Any) -> str | None:
    if v is None:
        return "missing or null"
    if isinstance(v, BadValue):
        return v.why
    if not isinstance(v, list) or not v:
        return f"expected a non-empty list of {{role, content}} messages, got {type_name(v)}"
    for i, m in enumerate(v):
        if not isinstance(m, dict):
            return f"message [{i}]: expected an object with role and content, got {type_name(m)}"
        for key in ("role", "content"):
            x = decode(m.get(key))
            if isinstance(x, BadValue):
                return f"message [{i}].{key}: {x.why}"
            if key == "content" and isinstance(x, list):
                if why := _parts_problem(i, x):
                    return why
                continue
            if not isinstance(x, str) or (key == "role" and not x):
                return f"message [{i}].{key}: expected a string, got {type_name(x)}"
            if not encodable(x):
                return f"message [{i}].{key}: not valid Unicode"
    return None


def _parts_problem(i: int, parts: list[Any]) -> str | None:
    """Message ``i``'s content as a list of OpenAI parts (text, images): ``image_values`` checks it."""
    return content_problem(i, parts)


def clean_messages(v: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Drop null keys (Parquet structs have every field) and decode bytes; content parts of text alone
    become one string (``image_values.clean_content``)."""
    return [{k: clean_content(x) if k == "content" else decode(x) for k, x in m.items() if x is not None}
            for m in v]


def check_carried(v: Any) -> str | None:
    if isinstance(v, BadValue):
        return v.why
    if isinstance(v, str) and not encodable(v):
        return "not valid Unicode (lone surrogate)"
    return None


def check_inputs(v: list[Any]) -> str | None:
    """The inputs of one embeddings request, each a text or token ids."""
    for i, one in enumerate(v):
        if error := check_prompt(one, "input"):
            return f"[{i}]: {error}"
    return None
