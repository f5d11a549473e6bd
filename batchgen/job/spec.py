"""The job file: a YAML document validated with pydantic into a ``JobSpec``.

Validation collects every problem, each named by its path in the file (``sampling.top_p: ...``).
Sampling rules are not repeated here: ``SamplingParams`` itself is asked, field by field.
Checks that touch the file system (model directory, input files and columns) live in
``validate.py``.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import re
import typing
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)

from ..engine.config import samples_problem
from ..models.resolve import ModelSource, model_source
from ..sampling_params import PYTHON_ONLY, BeamSearchParams, SamplingParams
from ..storage import Location, StorageOptions, location
from .adapters import LORA_COLUMN, JobAdapter, resolve_adapters
from .errors import JobError, JobInvalid, Problem
from .structured import OVERRIDE_KEYS, resolve_schema_file
from .tasks import EmbedSpec, ScoreSpec, Task, task_columns, task_options, task_problems

# Output columns a job can ask for; "token_counts" means num_prompt_tokens and num_output_tokens,
# "logprobs" means the per-token top logprobs and cumulative_logprob.
# "valid" and "parsed" are for structured outputs: whether the output is a whole string of its
# constraint, and the output as JSON re-serialised (null when cut by max_tokens or not JSON).
# "score" means cumulative_logprob and beam search's length-normalised score (a beam job's default).
# "prompt_logprobs": per prompt token its logprob and the top sampling.prompt_logprobs (its default when set).
OUTPUT_FIELDS = ("text", "token_ids", "logprobs", "finish_reason", "token_counts", "valid", "parsed", "score",
                 "prompt_logprobs")
DEFAULT_OUTPUT_FIELDS = ["text", "finish_reason", "token_counts"]
# Columns every part has; carried input columns may not use these names.
RESERVED_COLUMNS = frozenset({
    "id", "sample_index", "num_samples", "error", "text", "token_ids", "logprobs", "cumulative_logprob",
    "finish_reason", "stop_reason", "num_prompt_tokens", "num_output_tokens", "valid", "parsed", "score",
    "prompt_logprobs", *task_columns("score"), *task_columns("embed"), *task_columns("classify"),
})
# Beam search's own sampling fields, and the sampling fields it has no use for, each with the
# value that leaves it off.
BEAM_FIELDS = ("beam_width", "length_penalty", "early_stopping")
NOT_FOR_BEAMS = {"n": 1, "temperature": 0.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0,
                 "presence_penalty": 0.0, "frequency_penalty": 0.0, "logprobs": None, "structured_outputs": None,
                 "prompt_logprobs": None}


SAMPLING_DEFAULTS = {f.name: f.default for f in dataclasses.fields(SamplingParams) if f.init}


def beam_conflicts(values: dict[str, Any], names: typing.Iterable[str]) -> list[tuple[str, str]]:
    """(field, why) for the fields among `names` whose value in `values` asks a beam search for
    something it does not do (sampling, penalties, logprobs, constraints)."""
    return [(name, f"does not apply to beam search (sampling.beam_width); leave it out (got {values[name]!r})")
            for name in names if name in NOT_FOR_BEAMS and values.get(name) != NOT_FOR_BEAMS[name]]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelSpec(_Section):
    path: str = Field(min_length=1)  # a local dir, a Hugging Face Hub id, or a bucket URL (s3://, gs://)
    revision: str | None = None  # Hub ids: a branch, tag or commit (default: main)
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    device: str = "auto"
    block_size: PositiveInt = 16
    kv_cache_memory: Any = "4GiB"  # bytes or "4GiB"; the engine checks sizes
    swap_space: Any = "4GiB"
    gpu_memory_utilization: float | None = None  # passed to the engine only when set
    num_threads: PositiveInt | None = None  # passed to the engine only when set
    max_num_seqs: PositiveInt = 256
    max_num_batched_tokens: PositiveInt = 2048
    max_model_len: PositiveInt | None = None
    enable_prefix_caching: bool = True
    preemption_mode: Literal["swap", "recompute"] = "swap"
    seed: int = 0
    skip_tokenizer_init: bool = False  # token ids in, token ids out (no tokenizer files needed)
    model_impl: Literal["auto", "native", "transformers"] = "auto"
    quantization: Literal["int8"] | None = None  # int8 compute for the layers' projections (docs/int8.md)
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"] = "auto"  # fp8: half the KV bytes (docs/kv-cache.md)
    name: str | None = None  # the model's name in OpenAI batch output (default: the model dir's name)
    lora_modules: dict[str, str] | None = None  # LoRA adapters by name: a PEFT dir (local or a bucket URL)
    max_loras: PositiveInt | None = None  # adapters resident at once (default: all of lora_modules)
    max_cpu_loras: PositiveInt | None = None  # adapters kept in host memory (default: all)

    @field_validator("lora_modules")
    @classmethod
    def _adapter_names(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        for name, path in (v or {}).items():
            if not name.strip() or not path.strip():
                raise ValueError(f"each adapter needs a name and a path (got {name!r}: {path!r})")
        return v

    @model_validator(mode="after")
    def _lora_options(self) -> ModelSpec:
        given = [k for k in ("max_loras", "max_cpu_loras") if getattr(self, k) is not None]
        if given and not self.lora_modules:
            raise ValueError(f"{', '.join(given)} applies to LoRA adapters; set lora_modules")
        return self

    def engine_kwargs(self, model_path: Path) -> dict[str, Any]:
        """Keyword arguments for ``batchgen.LLM`` (and any injected engine factory); with adapters, every
        one resident unless ``max_loras`` says fewer (their rank comes from the adapters themselves,
        ``adapters.lora_rank_kwargs``)."""
        kw = self.model_dump()
        for where in ("path", "name", "revision", "lora_modules"):
            kw.pop(where)
        if self.lora_modules:
            kw |= {"enable_lora": True, "max_loras": self.max_loras or len(self.lora_modules)}
        for optional in ("gpu_memory_utilization", "num_threads", "max_loras", "max_cpu_loras", "quantization"):
            if kw[optional] is None:
                del kw[optional]
        return {"model": str(model_path), **kw}


class DatasetSpec(_Section):
    """``input.dataset``: a Hugging Face dataset, from the local cache or a ``save_to_disk`` dir."""

    path: str = Field(min_length=1)  # a Hub id (org/name), or a directory relative to the job file
    name: str | None = None  # the config
    split: str = "train"
    revision: str | None = None

    @field_validator("split")
    @classmethod
    def _split_name(cls, v: str) -> str:
        if not re.fullmatch(r"\w[\w.-]*", v):
            raise ValueError(f"a split's name such as train or test, not {v!r}: ids are <split>:<row>, so "
                             "split expressions (train[:100]) are not taken; shards divide a split")
        return v


class InputSpec(_Section):
    paths: list[str] | None = Field(default=None, min_length=1)
    dataset: DatasetSpec | None = None
    format: Literal["parquet", "jsonl", "csv", "tsv", "openai_batch"] | None = None
    id_column: str | None = None
    prompt_column: str | None = None
    messages_column: str | None = None
    completion_column: str | None = None  # task score: the completion scored after each row's prompt
    lora_column: str | None = None  # the LoRA adapter each row runs with (a model.lora_modules name; null: base)
    carry_columns: list[str] = Field(default_factory=list)
    check_model: bool = False  # openai_batch: a request whose body.model is not model.name is an error row
    images_column: str | None = None  # each row's image, or list of images, for a vision-language model
    max_image_size: int | str = "64MiB"  # an encoded image larger than this is the row's error
    max_image_pixels: PositiveInt = 64_000_000  # an image with more pixels is the row's error (bombs)
    image_memory: int | str = "4GiB"  # decoded images held at once (read ahead and in the engine), about

    @field_validator("max_image_size", "image_memory")
    @classmethod
    def _size(cls, v: Any) -> Any:
        from ..config import parse_bytes

        try:
            size = parse_bytes(v, "size")
        except ValueError:
            raise ValueError(f"{v!r} is not a size (bytes, or with a unit: '64MiB', '2GB')") from None
        if size <= 0:
            raise ValueError("must be more than 0 bytes")
        return v

    @field_validator("paths", mode="before")
    @classmethod
    def _one_path(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v

    @model_validator(mode="after")
    def _one_prompt_source(self) -> InputSpec:
        if (self.paths is None) == (self.dataset is None):
            raise ValueError("set one of paths (input files) or dataset (a Hugging Face dataset)")
        if self.dataset is not None and self.format is not None:
            raise ValueError("format applies to input.paths; a dataset has its own")
        if self.format == "openai_batch":
            given = [k for k in ("id_column", "prompt_column", "messages_column", "completion_column",
                                 "lora_column", "images_column") if getattr(self, k)]
            if given:
                raise ValueError(f"format openai_batch reads custom_id and the body's messages or prompt; "
                                 f"remove {', '.join(given)}")
        elif (self.prompt_column is None) == (self.messages_column is None):
            raise ValueError("set exactly one of prompt_column (text or token ids) or messages_column (chat)")
        if self.check_model and self.format != "openai_batch":
            raise ValueError("check_model applies to format openai_batch only")
        return self

    @property
    def source_column(self) -> str:
        if self.format == "openai_batch":
            return "body"
        return self.prompt_column or self.messages_column or ""

    @property
    def id_key(self) -> str | None:
        """The field holding row ids (None: ids are ``<file>:<row>``)."""
        return "custom_id" if self.format == "openai_batch" else self.id_column


class StructuredOutputsSpec(_Section):
    """``sampling.structured_outputs``; ``SamplingParams`` checks that one field is set."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    model_config = ConfigDict(extra="forbid", populate_by_name=True, serialize_by_alias=True)

    @field_validator("json_", mode="before")
    @classmethod
    def _schema(cls, v: Any) -> Any:
        if v is not None and not isinstance(v, (dict, str)):
            raise ValueError("must be a JSON schema: a mapping, JSON text, or the path of a .json file")
        return v


class _SamplingBase(_Section):
    """Base of ``SamplingSpec``; the SamplingParams fields are added by ``create_model``."""

    overrides: dict[str, str] = Field(default_factory=dict)
    beam_width: PositiveInt | None = None  # beam search: one output row per returned beam
    length_penalty: float = 1.0
    early_stopping: bool = False
    lora: str | None = None  # the LoRA adapter of every row (a model.lora_modules name) unless a row names one

    @field_validator("stop", mode="before", check_fields=False)
    @classmethod
    def _stop_list(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v

    def param_values(self) -> dict[str, Any]:
        """The SamplingParams fields as plain values (the constraint as a mapping of its set field)."""
        values = {k: getattr(self, k) for k in SamplingParams.field_names()}
        if isinstance(values["structured_outputs"], BaseModel):
            values["structured_outputs"] = values["structured_outputs"].model_dump(exclude_none=True)
        return values

    def params(self, **changes: Any) -> SamplingParams | BeamSearchParams:
        """The row's SamplingParams, or its BeamSearchParams when beam_width is set (a seed does not
        apply to a beam search and is dropped)."""
        values = self.param_values()
        values.update(changes)
        if self.beam_width is None:
            return SamplingParams(**values)
        changed = [name for name in NOT_FOR_BEAMS if values[name] != SAMPLING_DEFAULTS[name]]
        if conflicts := beam_conflicts(values, changed):
            name, why = conflicts[0]
            raise ValueError(f"SamplingParams.{name}: {why}")
        if values["max_tokens"] is None:
            raise ValueError("SamplingParams.max_tokens: a beam search needs max_tokens")
        keep = ("max_tokens", "min_tokens", "stop", "stop_token_ids", "ignore_eos", "include_stop_str_in_output",
                "skip_special_tokens")
        try:
            return BeamSearchParams(beam_width=self.beam_width, length_penalty=self.length_penalty,
                                    early_stopping=self.early_stopping, **{k: values[k] for k in keep})
        except ValueError as e:
            raise ValueError(str(e).replace("BeamSearchParams.", "SamplingParams.", 1)) from None


def _sampling_fields() -> dict[str, Any]:
    hints = typing.get_type_hints(SamplingParams)
    out: dict[str, Any] = {}
    names = SamplingParams.field_names()
    for f in dataclasses.fields(SamplingParams):
        if f.name not in names:
            continue
        ann = {"stop": list[str] | None, "structured_outputs": StructuredOutputsSpec | None}.get(f.name, hints[f.name])
        out[f.name] = (ann, f.default)
    return out


SamplingSpec = create_model("SamplingSpec", __base__=_SamplingBase, **_sampling_fields())


class OutputSpec(_Section):
    dir: str = Field(min_length=1)
    format: Literal["parquet", "jsonl", "openai_batch"] = "parquet"
    merge_to: str | None = None  # jsonl, openai_batch: once every row is done, one file in input order
    rows_per_part: PositiveInt = 1000
    max_error_rate: float | None = Field(default=None, ge=0, le=1)  # a run exits 65 above this share of error rows
    fields: list[Literal[OUTPUT_FIELDS]] = Field(  # type: ignore[valid-type]
        default_factory=lambda: list(DEFAULT_OUTPUT_FIELDS)
    )


class ShardSpec(_Section):
    index: NonNegativeInt | None = None
    count: PositiveInt | None = None

    @model_validator(mode="after")
    def _consistent(self) -> ShardSpec:
        if self.index is not None and self.count is None:
            raise ValueError("index needs count")
        if self.index is not None and self.count is not None and self.index >= self.count:
            raise ValueError(f"index must be < count ({self.count})")
        return self


class JobSpec(_Section):
    model: ModelSpec
    task: Task = "generate"
    input: InputSpec
    sampling: SamplingSpec = Field(default_factory=SamplingSpec)  # type: ignore[valid-type]
    score: ScoreSpec | None = None  # task score's options
    embed: EmbedSpec | None = None  # task embed's options
    output: OutputSpec
    shard: ShardSpec = Field(default_factory=ShardSpec)
    storage: StorageOptions = Field(default_factory=StorageOptions)  # buckets: endpoint, region, lease
    max_in_flight: PositiveInt | None = None  # default: 2 * model.max_num_seqs
    progress_interval: PositiveFloat = 30.0

    @model_validator(mode="after")
    def _beam_scores_by_default(self) -> JobSpec:
        """A beam job's rows carry their cumulative logprob and score unless output.fields says otherwise."""
        out = self.output
        if self.sampling.beam_width and "fields" not in out.model_fields_set and out.format != "openai_batch":
            out.fields = [*out.fields, "score"]
        return self

    @model_validator(mode="after")
    def _prompt_logprobs_by_default(self) -> JobSpec:
        """sampling.prompt_logprobs writes its column unless output.fields says which columns."""
        out = self.output
        asked = self.sampling.prompt_logprobs is not None or "prompt_logprobs" in self.sampling.overrides
        if asked and "fields" not in out.model_fields_set and out.format != "openai_batch":
            out.fields = [*out.fields, "prompt_logprobs"]
        return self

    @field_validator("model", mode="before")
    @classmethod
    def _model_path_only(cls, v: Any) -> Any:
        return {"path": v} if isinstance(v, str) else v

    @field_validator("shard", mode="before")
    @classmethod
    def _shard_text(cls, v: Any) -> Any:
        if v is None:  # as if not given: --shard, then Slurm's variables, else 0/1
            return {}
        if isinstance(v, str):
            try:
                i, n = (int(x) for x in v.split("/"))
            except ValueError:
                raise ValueError("must be INDEX/COUNT such as '0/4', or {index, count}") from None
            return {"index": i, "count": n}
        return v


def resolve_path(base_dir: Path, p: str) -> Path:
    """Relative paths in a job file are relative to the job file's directory."""
    path = Path(p).expanduser()
    return path if path.is_absolute() else base_dir / path


@dataclass
class Job:
    """A validated job: the spec plus where it came from (relative paths resolve against it)."""

    spec: JobSpec
    base_dir: Path
    text: str = ""  # the job file as written; saved next to the outputs
    source: Path | None = None
    warnings: list[str] = field(default_factory=list)  # from validation: worth a look, not fatal
    saved_digests: dict[str, str] | None = None  # a saved job's adapter digests (``from_saved``)

    def resolve(self, p: str) -> Path:
        return resolve_path(self.base_dir, p)

    def location(self, p: str) -> Location:
        """A path or URL of the job file (relative to its directory) on its store."""
        return location(p, self.base_dir, self.spec.storage)

    @cached_property
    def model_source(self) -> ModelSource:
        """Where the model comes from: a local dir (relative to the job file), a Hub id or a URL."""
        return model_source(self.spec.model.path, self.base_dir, self.spec.model.revision)

    @property
    def model_path(self) -> Path | str:
        """The model's local directory as written in the job file, or its Hub id or URL."""
        source = self.model_source
        return Path(source.ref) if source.kind == "local" else source.ref

    @property
    def model_name(self) -> str:
        return self.spec.model.name or self.model_source.name

    @cached_property
    def adapters(self) -> dict[str, JobAdapter]:
        """The job's LoRA adapters by name, found (a bucket's copied to this node) and digested."""
        return resolve_adapters(self.spec.model.lora_modules or {}, self.base_dir, self.spec.storage)

    @property
    def adapter_digests(self) -> dict[str, str]:
        if self.saved_digests is not None:
            return self.saved_digests
        return {name: a.digest for name, a in self.adapters.items()}

    @property
    def base_model_names(self) -> set[str]:
        """The names an OpenAI request's body.model may give the base model: the served name, and the
        model as the job names it."""
        return {self.model_name, self.spec.model.path, self.model_source.ref}

    @property
    def output_dir(self) -> Location:
        return self.location(self.spec.output.dir)

    @property
    def max_in_flight(self) -> int:
        return self.spec.max_in_flight or 2 * self.spec.model.max_num_seqs

    @cached_property
    def config_hash(self) -> str:
        """Hash of everything that changes what a row's output is (``config_fields``). A run
        refuses an output dir whose parts have another hash unless forced."""
        data = self.config_fields()
        _drop_later_defaults(data)
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]

    def config_fields(self) -> dict[str, Any]:
        """Everything that changes what a row's output is, by section.

        Left out on purpose: input paths (so files can be added), shard, engine capacity knobs,
        rows_per_part, max_in_flight, progress. A dataset is in, as its job file names it
        (path, config, split, revision). A run refuses an output dir whose parts have
        another hash unless forced.
        """
        s = self.spec
        data = {
            "model": {"path": self.model_source.identity, "revision": s.model.revision, "dtype": s.model.dtype,
                      "max_model_len": s.model.max_model_len, "model_impl": s.model.model_impl,
                      "quantization": s.model.quantization, "kv_cache_dtype": s.model.kv_cache_dtype},
            "input": s.input.model_dump(exclude={"paths", "image_memory"}),
            "sampling": s.sampling.model_dump(),
            "output": {"fields": sorted(s.output.fields), "format": s.output.format},
            "task": {"name": s.task, **task_options(s.task, getattr(s, s.task, None))},
        }
        if s.input.id_key is None and s.input.dataset is None:  # derived ids contain paths relative to the job file
            data["id_base"] = str(self.base_dir)
        if s.model.lora_modules:  # each adapter by name and content: other weights make another job
            data["model"]["lora_modules"] = self.adapter_digests
        return data

    def config_changes(self, other: Job) -> list[str]:
        """What differs in ``config_fields`` from ``other`` to this job, one ``field: old -> new``
        each (``sampling.temperature: 0.7 -> 0.9``)."""
        old, new = _flat(other.config_fields()), _flat(self.config_fields())
        names = {"id_base": "the job file's directory (ids are <file>:<row>)"}
        return [f"{names.get(key, key)}: {_shown(old.get(key))} -> {_shown(new.get(key))}"
                for key in sorted(old.keys() | new.keys()) if old.get(key) != new.get(key)]

    def saved_form(self) -> dict[str, Any]:
        """What a run stores in the output dir so ``batchgen status`` can find the input again."""
        saved = {
            "config_hash": self.config_hash,
            "base_dir": str(self.base_dir),
            "job_file": str(self.source) if self.source else None,
            "spec": self.spec.model_dump(mode="json"),
        }
        if self.spec.model.lora_modules:
            saved["lora_digests"] = self.adapter_digests
        return saved

    @classmethod
    def from_saved(cls, data: dict[str, Any]) -> Job:
        return cls(spec=JobSpec.model_validate(data["spec"]), base_dir=Path(data["base_dir"]),
                   saved_digests=data.get("lora_digests"))


# Fields added after jobs were first run, with their defaults: left out of the config hash when at
# their default, so an output dir written before they existed still matches its job.
_LATER_DEFAULTS = {("model", "model_impl"): "auto", ("model", "revision"): None, ("model", "quantization"): None,
                   ("model", "kv_cache_dtype"): "auto",
                   ("input", "check_model"): False,
                   ("input", "dataset"): None,
                   ("output", "format"): "parquet",
                   ("sampling", "structured_outputs"): None, ("sampling", "beam_width"): None,
                   ("sampling", "length_penalty"): 1.0, ("sampling", "early_stopping"): False,
                   ("sampling", "prompt_logprobs"): None, ("input", "completion_column"): None,
                   ("task", "name"): "generate", ("sampling", "lora"): None, ("input", "lora_column"): None,
                   ("sampling", "detokenize"): True, ("sampling", "spaces_between_special_tokens"): True,
                   ("input", "images_column"): None,
                   ("input", "max_image_size"): "64MiB", ("input", "max_image_pixels"): 64_000_000}
_LATER_SECTIONS = frozenset({"task"})  # left out of the hash when all their fields are at their defaults


def _flat(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested sections as ``section.field`` keys (a mapping value such as a schema stays whole
    below ``sampling.structured_outputs.<kind>``)."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value and name.count(".") < 2:
            out.update(_flat(value, name + "."))
        else:
            out[name] = value
    return out


def _shown(value: Any) -> str:
    """A value as the job file writes it (``null``, ``true``, ``'text'``, ``[1, 2]``), in 60 characters."""
    text = json.dumps(value, sort_keys=True) if isinstance(value, (dict, list, bool)) or value is None else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _drop_later_defaults(data: dict[str, Any]) -> None:
    for (section, key), default in _LATER_DEFAULTS.items():
        if data[section].get(key, default) == default:
            data[section].pop(key, None)
    for section in _LATER_SECTIONS:
        if not data[section]:
            del data[section]


# ---------------------------------------------------------------------------------------- loading


def read_job_text(path: str | Path) -> str:
    path = Path(path)
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise JobError(f"job file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise JobError(f"cannot read job file {path}: {e}") from None


class _UniqueKeys(yaml.SafeLoader):
    """YAML's safe loader refusing a key given twice in one mapping (where PyYAML keeps the last
    silently): ``sampling: {max_tokens: 0, max_tokens: 8}`` is a mistake, not a choice of 8."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        first: dict[tuple[str, str], yaml.Node] = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue
            seen = first.setdefault((key_node.tag, key_node.value), key_node)
            if seen is not key_node:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key_node.value!r} (first at line {seen.start_mark.line + 1}); "
                                "give each key once", key_node.start_mark)
        return super().construct_mapping(node, deep)


def parse_yaml(text: str) -> dict[str, Any]:
    """The job file as a dict; YAML errors (a key given twice among them) become one problem with line
    and column."""
    try:
        raw = yaml.load(text, Loader=_UniqueKeys)  # a SafeLoader: no Python objects
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        what = getattr(e, "problem", None) or str(e)
        raise JobInvalid([Problem("", f"invalid YAML{where}: {what}{_yaml_context(e)}")]) from None
    if raw is None:
        raise JobInvalid([Problem("", "the job file is empty")])
    if not isinstance(raw, dict):
        raise JobInvalid([Problem("", "the job file must be a mapping: model, input, sampling, output, ...")])
    return raw


def _yaml_context(e: yaml.YAMLError) -> str:
    """Where the construct a YAML error is in began, when that is on an earlier line than the error: an
    unclosed ``[``, ``{`` or quote is found only on a later line."""
    mark, context = getattr(e, "context_mark", None), getattr(e, "context", None)
    problem = getattr(e, "problem_mark", None)
    if mark is None or not context or (problem is not None and problem.line <= mark.line):
        return ""
    if "flow" not in context and "quoted" not in context:  # a block's start says nothing new
        return ""
    return f" ({context.removeprefix('while ')} begun at line {mark.line + 1}, column {mark.column + 1})"


def load_job(path: str | Path) -> Job:
    """Read and validate a job file (schema only, see ``validate.py`` for files and columns)."""
    path = Path(path)
    return parse_job(read_job_text(path), path.resolve().parent, source=path.resolve())


def parse_job(text: str, base_dir: Path, source: Path | None = None) -> Job:
    raw = parse_yaml(text)
    problems = resolve_schema_file(raw, base_dir) + spec_problems(raw)
    if problems:
        raise JobInvalid(problems)
    return Job(spec=JobSpec.model_validate(raw), base_dir=base_dir, text=text, source=source)


def spec_problems(raw: dict[str, Any]) -> list[Problem]:
    """Schema problems (pydantic) plus the rules pydantic cannot express, for every section."""
    problems: list[Problem] = []
    try:
        JobSpec.model_validate(raw)
    except ValidationError as e:
        problems += [_problem(err) for err in e.errors()]
    sampling = valid_part(SamplingSpec, raw.get("sampling") or {})
    if sampling is not None:
        problems += sampling_problems(sampling)
    output = valid_part(OutputSpec, raw.get("output"))
    wants_logprobs = output is not None and "logprobs" in output.fields
    if wants_logprobs and sampling is not None and sampling.logprobs is None:
        problems.append(Problem("output.fields", "'logprobs' needs sampling.logprobs "
                                                 "(0: the sampled token's logprob only; k: also the top k)"))
    model = model_part(raw)
    if model is not None and sampling is not None:
        problems += engine_fit_problems(model, sampling, raw.get("input"), output, raw.get("task", "generate"))
    inp = raw.get("input")
    carry = inp.get("carry_columns") if isinstance(inp, dict) else None
    for i, col in enumerate(carry if isinstance(carry, list) else []):
        if col in RESERVED_COLUMNS:
            problems.append(Problem(f"input.carry_columns[{i}]", f"{col!r} is an output column name"))
    if output is not None:
        problems += output_format_problems(output, carry)
    problems += task_problems(raw)
    problems += image_problems(raw)
    problems += lora_problems(model, sampling, raw.get("input"))
    if sampling is not None and output is not None and raw.get("task", "generate") == "generate":
        problems += prompt_logprobs_problems(sampling, output)
    return problems


def image_problems(raw: dict[str, Any]) -> list[Problem]:
    """Images are prompts to generate from: a task that scores, embeds or classifies takes none."""
    inp, task = raw.get("input"), raw.get("task", "generate")
    if isinstance(inp, dict) and inp.get("images_column") and task != "generate":
        return [Problem("input.images_column", f"images are read for task generate only, not {task}")]
    return []


def lora_problems(model: ModelSpec | None, sampling: Any, inp: Any) -> list[Problem]:
    """The fields that name adapters need ``model.lora_modules``, and the job-wide one must be among them."""
    if model is None:
        return []
    names = list(model.lora_modules or {})
    inp = inp if isinstance(inp, dict) else {}
    problems = []
    if inp.get("lora_column") and not names:
        problems.append(Problem("input.lora_column", "names each row's LoRA adapter; list the adapters in "
                                                     "model.lora_modules"))
    wanted = sampling.lora if sampling is not None else None
    if wanted is not None and wanted not in names:
        why = f"{wanted!r} is not in model.lora_modules (has: {', '.join(names)})" if names else \
            "names a LoRA adapter; list the adapters in model.lora_modules"
        problems.append(Problem("sampling.lora", why))
    if wanted is not None and inp.get("lora_column"):
        problems.append(Problem("sampling.lora", "set one of sampling.lora (every row's adapter) or "
                                                 "input.lora_column (each row's own)"))
    carry = inp.get("carry_columns")
    if names and isinstance(carry, list) and LORA_COLUMN in carry:
        problems.append(Problem(f"input.carry_columns[{carry.index(LORA_COLUMN)}]",
                                f"{LORA_COLUMN!r} is the output column naming each row's adapter"))
    return problems


def prompt_logprobs_problems(sampling: Any, output: OutputSpec) -> list[Problem]:
    """sampling.prompt_logprobs and its output column come together: nothing computed and dropped."""
    asked = sampling.prompt_logprobs is not None or "prompt_logprobs" in sampling.overrides
    written = "prompt_logprobs" in output.fields
    chosen = "fields" in output.model_fields_set  # else the column comes with sampling.prompt_logprobs
    if output.format == "openai_batch" and asked:
        where = "sampling.prompt_logprobs" if sampling.prompt_logprobs is not None else \
            "sampling.overrides.prompt_logprobs"
        return [Problem(where, "the OpenAI batch shape has no place for them; a /v1/completions request "
                               "with echo and logprobs gets its prompt's logprobs first")]
    if asked and chosen and not written:
        return [Problem("output.fields", "add 'prompt_logprobs': sampling.prompt_logprobs computes them")]
    if written and not asked:
        return [Problem("output.fields", "'prompt_logprobs' needs sampling.prompt_logprobs "
                                         "(0: each prompt token's logprob only; k: also the top k)")]
    return []


def output_format_problems(output: OutputSpec, carry: Any) -> list[Problem]:
    """The OpenAI batch output has a fixed shape: no chosen columns, nothing carried."""
    problems = []
    if output.format == "openai_batch":
        if "fields" in output.model_fields_set:
            problems.append(Problem("output.fields", "output.format openai_batch writes the OpenAI response "
                                                     "shape; remove fields (logprobs come with sampling.logprobs)"))
        if carry:
            problems.append(Problem("input.carry_columns", "output.format openai_batch has no place for "
                                                           "carried columns; use format jsonl or parquet"))
    if output.merge_to is not None and output.format == "parquet":
        problems.append(Problem("output.merge_to", "merging into one file needs output.format jsonl or "
                                                   "openai_batch (a Parquet dir reads as one dataset)"))
    return problems


def engine_fit_problems(model: ModelSpec, sampling: Any, inp: Any, output: OutputSpec | None,
                        task: str = "generate") -> list[Problem]:
    """Sampling and input settings the engine options cannot serve: refused here, before any
    row, instead of failing every row."""
    problems = []
    width_field = "beam_width" if sampling.beam_width else "n"
    if too_many := samples_problem(getattr(sampling, width_field), model.max_num_seqs):
        problems.append(Problem(f"sampling.{width_field}", too_many))
    if model.skip_tokenizer_init:
        why = "needs the model's tokenizer, which model.skip_tokenizer_init leaves out"
        if isinstance(inp, dict) and inp.get("messages_column"):
            problems.append(Problem("input.messages_column", f"chat messages: {why}; give token ids"))
        if output is not None and "text" in output.fields and task == "generate":
            problems.append(Problem("output.fields", f"'text' {why}; use token_ids"))
        if sampling.stop:
            problems.append(Problem("sampling.stop", f"stop strings: {why}; use stop_token_ids"))
    return problems


def sampling_problems(spec: Any) -> list[Problem]:
    """Ask SamplingParams about every field: on an error, note it, reset that field, try again."""
    names = SamplingParams.field_names()
    defaults = SAMPLING_DEFAULTS
    values = spec.param_values()
    problems: list[Problem] = []
    for _ in range(len(names) + 1):
        try:
            SamplingParams(**values)
            break
        except (ValueError, TypeError) as e:
            m = re.match(r"SamplingParams\.(\w+)((?:\.\w+)*): (.*)$", str(e), re.DOTALL)
            if not m or m.group(1) not in values or values[m.group(1)] == defaults[m.group(1)]:
                problems.append(Problem("sampling", str(e)))
                break
            problems.append(Problem(f"sampling.{m.group(1)}{m.group(2)}", m.group(3)))
            values[m.group(1)] = defaults[m.group(1)]
    if spec.beam_width is None:
        problems += [Problem(f"sampling.{name}", "applies to beam search only; set sampling.beam_width")
                     for name in BEAM_FIELDS[1:] if name in spec.model_fields_set]
    else:
        problems += [Problem(f"sampling.{name}", why) for name, why in beam_conflicts(values, spec.model_fields_set)]
        problems += [Problem(f"sampling.overrides.{name}", "does not apply to beam search (sampling.beam_width)")
                     for name in spec.overrides if name in NOT_FOR_BEAMS]
        if spec.max_tokens is None:
            problems.append(Problem("sampling.max_tokens", "a beam search needs max_tokens"))
    for key in spec.overrides:
        if key in PYTHON_ONLY:
            problems.append(Problem(f"sampling.overrides.{key}", PYTHON_ONLY[key]))
        elif key not in names and key not in OVERRIDE_KEYS and key not in BEAM_FIELDS:
            hint = suggest(key, [*names, *OVERRIDE_KEYS])
            problems.append(Problem(f"sampling.overrides.{key}", f"not a sampling field{hint}"))
    return problems


def model_part(raw: dict[str, Any]) -> ModelSpec | None:
    """The model section as far as it is valid (``model: PATH`` is short for ``{path: PATH}``)."""
    section = raw.get("model")
    return valid_part(ModelSpec, {"path": section} if isinstance(section, str) else section)


def valid_part(model: type[BaseModel], raw: Any) -> Any:
    """The section validated without its fields that have schema errors (already reported), so
    the semantic checks still run on the rest; None when that is not possible."""
    if not isinstance(raw, dict):
        return None
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        bad = {err["loc"][0] for err in e.errors() if err["loc"]}
        try:
            return model.model_validate({k: v for k, v in raw.items() if k not in bad})
        except ValidationError:
            return None


def _loc_text(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _problem(err: Any) -> Problem:
    loc = tuple(err["loc"])
    kind = err["type"]
    if kind == "missing":
        return Problem(_loc_text(loc), "required field is missing")
    if kind == "extra_forbidden" and loc[0] == "sampling" and str(loc[-1]) in PYTHON_ONLY:
        return Problem(_loc_text(loc), PYTHON_ONLY[str(loc[-1])])
    if kind == "extra_forbidden":
        hint = suggest(str(loc[-1]), _field_names_at(loc[:-1]))
        return Problem(_loc_text(loc), f"unknown field{hint}")
    msg = err["msg"].removeprefix("Value error, ")
    msg = msg[:1].lower() + msg[1:]
    value = err.get("input")
    if isinstance(value, (str, int, float, bool)) and not kind.startswith("value_error"):
        msg += f" (got {value!r})"
    return Problem(_loc_text(loc), msg)


def _field_names_at(loc: tuple[Any, ...]) -> list[str]:
    return field_names(section_at([str(part) for part in loc]))


def section_at(path: list[str]) -> type[BaseModel] | None:
    """The section (a pydantic model) at ``path`` in the job file's schema (``["sampling",
    "structured_outputs"]``); None where the path leads to no section."""
    model: type[BaseModel] | None = JobSpec
    for part in path:
        field = field_named(model, part) if model is not None else None
        if field is None:
            return None
        model = section_type(field.annotation)
    return model


def field_named(model: type[BaseModel], name: str) -> Any:
    """The field of ``model`` a job file names ``name`` (its alias where it has one), or None."""
    return next((f for key, f in model.model_fields.items() if (f.alias or key) == name), None)


def field_names(model: type[BaseModel] | None) -> list[str]:
    """The names a job file gives the fields of ``model`` (aliases where they have one)."""
    return [f.alias or key for key, f in model.model_fields.items()] if model is not None else []


def section_type(annotation: Any) -> type[BaseModel] | None:
    """The section class in a field's annotation (``ScoreSpec | None`` -> ``ScoreSpec``), or None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next((t for t in map(section_type, typing.get_args(annotation)) if t is not None), None)


def suggest(name: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(name, choices, n=1)
    if close:
        return f" (did you mean {close[0]!r}?)"
    return f" (valid: {', '.join(choices)})" if choices else ""
