"""The types every input format and the reader share: an input file, a record read from it, the
row made of a record, a row's ids. The output side (the OpenAI response shape) imports ``Row``
and the endpoint names from here, so nothing on the input side imports the output side."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from ...storage import Location

CHAT = "chat"  # a row of chat messages: the OpenAI chat.completion shape
COMPLETION = "completion"  # a row with a prompt: the OpenAI text_completion shape
EMBEDDING = "embedding"  # a row of inputs to embed (its prompt is their list): the OpenAI embedding list shape


class BadValue:
    """A value that could not be read (bad UTF-8, a type other than the column's); ``why``
    becomes the row's error, after the field's name."""

    __slots__ = ("why",)

    def __init__(self, why: str):
        self.why = why

    def __repr__(self) -> str:
        return f"BadValue({self.why!r})"


BAD_UTF8 = BadValue("invalid UTF-8")


@dataclass(frozen=True)
class DatasetRef:
    """A Hugging Face dataset split, as ``input.dataset`` names it once resolved."""

    path: str  # a local directory (absolute) or a Hub id
    name: str | None  # the config
    split: str
    revision: str | None
    saved: bool  # a save_to_disk directory (no configs, no revisions)


@dataclass(frozen=True)
class InputFile:
    """A file of rows, or a dataset split (``path`` None, ``dataset`` set)."""

    path: Location | None
    format: str
    name: str  # used in derived ids (``<name>:<row>``) and, unless ``label`` is set, in messages
    label: str = ""
    dataset: DatasetRef | None = None
    line_ids_from: int = 1  # derived ids of a line-numbered file: the first line's number (job/line_ids.py)

    @property
    def shown(self) -> str:
        """The file (or dataset split) in messages."""
        return self.label or self.name

    def where(self, index: int) -> str:
        """A row's place in messages: JSONL lines count from 1, rows of other formats from 0."""
        return f"{self.shown} line {index + 1}" if self.format in TEXT_LINES else f"{self.shown} row {index}"

    def derived_id(self, index: int) -> str:
        """The id of row `index` (from 0) without an id of its own: ``<name>:<line>`` for a line-numbered file
        (lines from `line_ids_from`), ``<name>:<row>`` from 0 for the others."""
        return f"{self.name}:{index + self.line_ids_from if self.format in TEXT_LINES else index}"

    def place(self, record: Record) -> tuple[str, str]:
        """(derived id, place in messages) of a record."""
        if record.unnumbered is not None:
            return f"{self.name}:{record.unnumbered}", f"{self.shown} {record.unnumbered}"
        return self.derived_id(record.index), self.where(record.index)

    def place_for(self, record: Record, row_id: str) -> str:
        """The place in messages of `record` read as row `row_id`. A derived id and the message count lines
        alike (``in.jsonl line 4`` is row ``in.jsonl:4``), except in an output dir begun when derived ids
        counted from 0: there a row whose id is derived leads with that id and names the line beside it
        (``in.jsonl:3 (line 4)``)."""
        derived, where = self.place(record)
        if (row_id == derived and self.format in TEXT_LINES and record.unnumbered is None
                and self.line_ids_from != 1):
            return f"{derived} (line {record.index + 1})"
        return where


TEXT_LINES = frozenset({"jsonl", "openai_batch"})  # formats whose rows are numbered by physical line


class Record(NamedTuple):
    """One row as a format reads it: its number in the file, its values by column (None when the
    row could not be read at all, or was not parsed) and why it could not be read. A row the
    format cannot place among the numbered rows (a malformed CSV line) has a name instead,
    ``unnumbered``, which its id and messages use in place of the number."""

    index: int
    values: dict[str, Any] | None
    error: str | None = None
    unnumbered: str | None = None


class Source(Protocol):
    """One input file opened in its format. ``strict``: every column the job reads must be in
    the file's schema or header (Parquet), rather than possibly on any row (JSONL)."""

    file: InputFile
    strict: bool

    def column_names(self) -> set[str] | None:
        """The file's columns (None: an empty file, nothing to check yet); a file that cannot
        be read raises ``JobError``."""
        ...

    def count(self) -> tuple[int | None, bool]:
        """(rows, exact?), cheaply or not at all."""
        ...

    def records(self, columns: list[str], parse: bool = True) -> Iterator[Record]:
        """Every row, streaming, with the values of ``columns`` (``parse`` False: the numbers
        alone are wanted)."""
        ...


@dataclass(frozen=True)
class InputId:
    """A row's output id, and the id whose shard the row belongs to (another for a duplicate)."""

    id: str
    owner: str = ""
    duplicate: str | None = None  # for a row repeating an earlier row's id: the error row's message

    @property
    def shard_id(self) -> str:
        return self.owner or self.id


@dataclass
class Row:
    id: str
    where: str  # "data/a.jsonl line 7" or "data/a.parquet row 6"
    prompt: str | list[int] | list[dict[str, Any]] | None = None
    overrides: dict[str, Any] = field(default_factory=dict)
    carry: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    endpoint: str = COMPLETION  # chat (messages) or completion (a prompt): the OpenAI output shape
    prompt_field: str = ""  # where the prompt came from, for messages: a column, or body.messages
    sources: dict[str, str] = field(default_factory=dict)  # override -> the field it came from, when not a column
    top_logprobs: int | None = None  # the row's sampling logprobs, once its params are known
    completion: str | list[int] | None = None  # task score: what is scored after the prompt
    options: dict[str, Any] = field(default_factory=dict)  # an OpenAI request's own (echo, dimensions, ...)
    lora: str | None = None  # the LoRA adapter the row names (None: the base model)
    lora_field: str = ""  # where the row chose its model (input.lora_column, body.model); "": sampling.lora's
    images: list[Any] = field(default_factory=list)  # input.images_column's values, read but not decoded yet
    image_base: Location | None = None  # where relative image paths are read from: the input file's directory


def decode(v: Any) -> Any:
    """Bytes as text (``BAD_UTF8`` when they are not UTF-8); anything else as it is."""
    if isinstance(v, bytes):
        try:
            return v.decode("utf-8")
        except UnicodeDecodeError:
            return BAD_UTF8
    return v


def type_name(v: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "an integer",
            float: "a number", type(None): "null"}.get(type(v), type(v).__name__)
