"""Small helpers for error messages, below every other module of the package (it imports none of them)."""

from __future__ import annotations


def first_line(error: BaseException) -> str:
    """An error's first line (transformers' messages run to many), or its type when empty."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
