"""The input side of a job: finding the input files, reading each format as a stream, and
making rows (ids, shards, duplicates, prompts, overrides, carried values) of what is read."""

from .discover import discover, file_format
from .openai_batch import ignored_summary
from .reader import InputReader
from .rows import InputFile, InputId, Row

__all__ = ["InputFile", "InputId", "InputReader", "Row", "discover", "file_format", "ignored_summary"]
