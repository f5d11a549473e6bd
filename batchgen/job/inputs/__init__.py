"""The input side of a job: finding the input files, reading each format as a stream, and
making rows (ids, shards, duplicates, prompts, overrides, carried values) of what is read."""

from .reader import InputFile, InputId, InputReader, Row, discover, file_format

__all__ = ["InputFile", "InputId", "InputReader", "Row", "discover", "file_format"]
