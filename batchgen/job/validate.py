"""Everything ``batchgen validate`` checks, also run before every ``batchgen run``: the schema,
the sampling rules, the model directory, the input files and their columns. Each section is
checked on its own so one broken section does not hide the problems of another."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from ..lora.request import LoRARequest
from ..models.resolve import fetch_note, locate_model, model_source
from ..storage import Location, StorageOptions, is_url, location
from ..storage.model_cache import ModelCache
from .adapters import adapter_dir
from .engine import EngineFactory, config_checker
from .errors import JobError, JobInvalid, Problem
from .inputs import InputReader, discover
from .inputs.jsonl import INFER_LINES
from .inputs.reader import repeated_ids
from .inputs.values import CHAT_AS_PROMPT
from .overrides import Overrides
from .spec import (
    InputSpec,
    Job,
    JobSpec,
    ModelSpec,
    OutputSpec,
    SamplingSpec,
    model_part,
    parse_yaml,
    read_job_text,
    spec_problems,
)
from .structured import resolve_schema_file
from .tasks import EmbedSpec, dimensions_problem


def validate_job_file(path: str | Path, factory: EngineFactory | None = None,
                      overrides: Overrides | None = None) -> Job:
    """The validated job, with warnings (e.g. optional columns seen nowhere) in ``Job.warnings``;
    raises ``JobInvalid`` listing every problem found. With an engine ``factory`` the engine also
    checks its options against the model (``batchgen validate``); without one, only the options
    (``batchgen run``, whose engine checks the rest when it is built, before any row). ``overrides``
    (``run --set``/``--limit``) change the job before it is checked."""
    path = Path(path)
    return validate_job_text(read_job_text(path), path.resolve().parent, path.resolve(), factory, overrides)


def validate_job_text(text: str, base_dir: Path, source: Path | None = None,
                      factory: EngineFactory | None = None, overrides: Overrides | None = None) -> Job:
    """``validate_job_file`` for a job given as YAML text (``batchgen run-batch`` builds one)."""
    raw = parse_yaml(text)
    if overrides:
        raw = overrides.apply(raw)
        text = overrides.job_text(raw, source)
    return validate_job_dict(raw, text, base_dir, source, factory)


def validate_job_dict(raw: dict[str, Any], text: str, base_dir: Path, source: Path | None = None,
                      factory: EngineFactory | None = None) -> Job:
    """``validate_job_text`` for the parsed job file (``text``: what is saved beside the outputs)."""
    problems = resolve_schema_file(raw, base_dir) + spec_problems(raw)
    storage = _part(StorageOptions, raw.get("storage") or {})
    warnings: list[str] = []
    sampling = _part(SamplingSpec, raw.get("sampling") or {})
    model = model_part(raw)
    if model is not None:
        problems += model_problems(model, base_dir, factory, storage, warnings)
        problems += adapter_problems(model, base_dir, storage, warnings)
        problems += embed_problems(raw, model, base_dir)
        problems += image_model_problems(raw, model, base_dir)
        if sampling is not None and (w := max_tokens_warning(sampling.max_tokens, context_length(model, base_dir),
                                                             model.max_model_len)):
            warnings.append(w)
    output = _part(OutputSpec, raw.get("output"))
    try:
        exclude = None if output is None else location(output.dir, base_dir, storage)
    except OSError as e:
        problems.append(Problem("output.dir", str(e)))
        exclude = None
    if exclude is not None and (why := output_dir_problem(exclude)):
        problems.append(Problem("output.dir", why))
    inp = _part(InputSpec, raw.get("input"))
    if inp is not None:
        overrides = sampling.overrides if sampling is not None else {}
        problems += input_problems(inp, base_dir, overrides, exclude, warnings, storage)
        if exclude is not None and not exclude.is_local and not problems:  # one line for one cause
            try:
                exclude.prepare_dir()  # the bucket exists and answers (creates nothing)
            except OSError as e:
                problems.append(Problem("output.dir", str(e)))
    if problems:
        raise JobInvalid(sorted(problems, key=_section_rank))
    return Job(spec=JobSpec.model_validate(raw), base_dir=base_dir, text=text, source=source, warnings=warnings)


def model_problems(model: ModelSpec, base_dir: Path, factory: EngineFactory | None = None,
                   storage: StorageOptions | None = None, warnings: list[str] | None = None) -> list[Problem]:
    """The model's problems, fetching nothing: a local dir must be there; a Hub id must be in the
    Hub cache (offline) or on the Hub; a bucket URL must list files. A model found here is checked
    with the engine options; one that the run will fetch first gets a warning instead."""
    source = model_source(model.path, base_dir, model.revision)
    if why := source.revision_problem():
        return [Problem("model.revision", why), *engine_option_problems(model.engine_kwargs(Path(source.ref)))]
    if source.kind == "local":
        p = Path(source.ref)
        if p.is_dir():
            return engine_option_problems(model.engine_kwargs(p), factory)
        why = f"no model directory at {p}" if not p.exists() else \
            f"{p} is not a directory (need a Hugging Face model dir)"
        return [Problem("model.path", why), *engine_option_problems(model.engine_kwargs(p))]
    try:
        found = locate_model(source, storage)
    except OSError as e:  # ModelNotFound, StorageError: one line each
        return [Problem("model.path", str(e)), *engine_option_problems(model.engine_kwargs(Path(source.ref)))]
    if found is None:
        if warnings is not None:
            warnings.append(f"model.path: {fetch_note(source)}")
        return engine_option_problems(model.engine_kwargs(Path(source.ref)))
    return engine_option_problems(model.engine_kwargs(found), factory)


def engine_option_problems(kwargs: dict[str, Any], factory: EngineFactory | None = None) -> list[Problem]:
    """The engine's own checks, each problem at its field: of the options against the model when
    the factory offers them (``check_config``, as ``batchgen.LLM`` does), else of the options alone
    (``batchgen.config.EngineConfig``, skipped when the engine is not importable)."""
    check = config_checker(factory) if factory is not None else None
    try:
        if check is not None:
            found = check(**kwargs)
        else:
            from ..config import ConfigError, EngineConfig

            try:
                EngineConfig(**kwargs)
                found = []
            except ConfigError as e:
                found = e.problems
    except ImportError:
        return []
    except (OSError, ValueError) as e:  # e.g. a model dir without config.json
        return [Problem("model.path", str(e))]
    fields = {"model": "model.path", "enable_lora": "model.lora_modules", "max_lora_rank": "model.lora_modules"}
    return [Problem(fields.get(p.option, f"model.{p.option}"), p.message) for p in found]


def adapter_problems(model: ModelSpec, base_dir: Path, storage: StorageOptions | None = None,
                     warnings: list[str] | None = None) -> list[Problem]:
    """One problem per adapter of ``model.lora_modules`` that a run could not apply: not there, a PEFT
    config batchgen refuses, or (when the base model is here to read its config) weights whose modules or
    shapes are not the model's. A bucket's adapter not copied to this node yet is checked by the run."""
    if not model.lora_modules:
        return []
    shapes = _projection_shapes(model, base_dir)
    problems = []
    for name, path in model.lora_modules.items():
        where = f"model.lora_modules.{name}"
        try:
            local = _adapter_here(name, path, base_dir, storage)
        except JobError as e:
            problems.append(Problem(where, str(e).removeprefix(f"{where}: ")))
            continue
        if local is None:
            if warnings is not None:
                warnings.append(f"{where}: {path} is not copied to this node yet; the run copies and checks it")
            continue
        if why := check_adapter(LoRARequest(name, 1, str(local)), shapes):
            problems.append(Problem(where, why.removeprefix("lora_request: ")))
    return problems


def _adapter_here(name: str, path: str, base_dir: Path, storage: StorageOptions | None) -> Path | None:
    """The adapter's local directory, fetching nothing (None: a bucket's adapter not copied yet)."""
    if not is_url(path):
        return adapter_dir(name, path, base_dir, storage)
    try:
        cache = ModelCache(location(path, options=storage))
        return cache.dir if cache.is_current(cache.remote_files()) else None
    except (OSError, ValueError) as e:
        raise JobError(f"model.lora_modules.{name}: {e}") from None


def _projection_shapes(model: ModelSpec, base_dir: Path) -> dict[tuple[int, str], tuple[int, int]] | None:
    """The base model's LoRA projections from its config, when it is a local dir whose config reads and it
    runs natively (on the transformers backend, the linears' names are its code's: the run checks them)."""
    source = model_source(model.path, base_dir, model.revision)
    if source.kind != "local" or not (Path(source.ref) / "config.json").is_file():
        return None
    from ..config import ConfigError
    from ..engine.preflight import read_hf_config
    from ..lora.shapes import projection_shapes
    from ..models.architectures import pick_impl

    try:
        hf_config = read_hf_config(Path(source.ref))
        if pick_impl(model.model_impl, hf_config) != "native":
            return None
        return projection_shapes(hf_config)
    except (ConfigError, ValueError, AttributeError, TypeError):  # the model's own problem, reported at model.path
        return None


def check_adapter(request: LoRARequest, shapes: dict[tuple[int, str], tuple[int, int]] | None) -> str | None:
    """Why the adapter cannot be applied (its config; with ``shapes``, its weights too), or None."""
    import torch

    from ..lora.checkpoint import AdapterError, load_adapter, read_config

    try:
        if shapes is None:
            read_config(request)
        else:
            load_adapter(request, shapes, torch.float32)
    except AdapterError as e:
        return str(e)
    return None


def context_length(model: ModelSpec, base_dir: Path) -> int | None:
    """The model's context as the engine will take it, when known without loading anything:
    ``model.max_model_len``, else the ``max_position_embeddings`` of a local model's config.json
    (a model the run fetches first is checked by the run)."""
    if model.max_model_len is not None:
        return model.max_model_len
    limit = (text_config(model, base_dir) or {}).get("max_position_embeddings")
    return limit if isinstance(limit, int) else None


def model_config(model: ModelSpec, base_dir: Path) -> dict[str, Any] | None:
    """A local model's config.json, read as JSON; None for a model the run fetches first, or one whose config
    does not read (a problem of model.path)."""
    source = model_source(model.path, base_dir, model.revision)
    if source.kind != "local":
        return None
    try:
        config = json.loads((Path(source.ref) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def text_config(model: ModelSpec, base_dir: Path) -> dict[str, Any] | None:
    """``model_config``, or its ``text_config`` for a vision-language model."""
    config = model_config(model, base_dir)
    if config is None:
        return None
    return config["text_config"] if isinstance(config.get("text_config"), dict) else config


def image_model_problems(raw: dict[str, Any], model: ModelSpec, base_dir: Path) -> list[Problem]:
    """``input.images_column`` for a local model whose config.json has no ``vision_config``: a text-only model
    (a model the run fetches first is checked by the run, once loaded)."""
    inp = raw.get("input")
    if not (isinstance(inp, dict) and inp.get("images_column")):
        return []
    config = model_config(model, base_dir)
    if config is None or config.get("vision_config") is not None:
        return []
    return [Problem("input.images_column", f"model {model.path} takes no images: its config.json has no "
                                           "vision_config (not a vision-language model)")]


def max_tokens_warning(max_tokens: int | None, limit: int | None, asked: int | None) -> str | None:
    """A warning when ``sampling.max_tokens`` does not fit in the context (``limit`` tokens;
    ``asked``: the job's model.max_model_len): an output then ends early, cut to what is left."""
    if max_tokens is None or limit is None or max_tokens < limit:
        return None
    whose = "model.max_model_len" if asked is not None else "the model's length"
    return (f"sampling.max_tokens: {max_tokens} does not fit in the context of {limit} tokens ({whose}); "
            "prompt and output share it, so an output ends where it is full (finish_reason \"length\")")


def output_dir_problem(out: Location) -> str | None:
    """Why ``out`` cannot be an output dir: it, or the nearest of its parents that exists, is a
    file (the run could create no parts there). A bucket that cannot be reached is the run's to
    report, with the store's own message."""
    try:
        if out.is_file():
            return f"{out} is a file; output.dir must be a directory (it is made if missing)"
        if out.is_local:
            parent = next((p for p in out.local.parents if p.exists()), None)
            if parent is not None and not parent.is_dir():
                return f"{parent} is a file, so {out} cannot be made; output.dir must be a directory"
    except OSError:
        return None
    return None


def input_problems(inp: InputSpec, base_dir: Path, overrides: dict[str, str], exclude: Location | None = None,
                   warnings: list[str] | None = None, storage: StorageOptions | None = None) -> list[Problem]:
    """Problems of the input files and columns; the reader's warnings are added to ``warnings``."""
    files, problems = discover(inp, base_dir, exclude, storage)
    reader = InputReader(inp, base_dir, overrides, files=files, storage=storage)
    try:
        problems += reader.check()
    except JobError as e:
        problems.append(Problem("input", str(e)))
    if warnings is not None:
        warnings += reader.warnings
    return problems


def check_rows(job: Job) -> None:
    """``batchgen validate``'s reading of the rows themselves (a run reads none before it starts, and a
    rerun none at all): a chat column read as prompts is refused (``JobInvalid``), repeated ids are a
    warning added to ``job.warnings``."""
    if problems := chat_prompt_problems(InputReader.for_job(job, read_only=True)):
        raise JobInvalid(problems)
    if repeated := duplicate_ids_warning(job):
        job.warnings.append(repeated)


def chat_prompt_problems(reader: InputReader) -> list[Problem]:
    """A prompt column holding chat messages, seen in the first rows: every row would be an error row."""
    column = reader.spec.prompt_column
    if column is None or reader.spec.format == "openai_batch":
        return []
    for row in itertools.islice(reader.rows(), INFER_LINES):
        if row.error and CHAT_AS_PROMPT in row.error:
            return [Problem("input.prompt_column", f"column {column!r} holds chat messages ({row.where}); "
                                                   f"set input.messages_column: {column} instead")]
    return []


def duplicate_ids_warning(job: Job) -> str | None:
    """The input rows repeating an earlier row's id (``batchgen validate``; ``status`` says the same), or
    None. Reads every id: the id column alone where the format allows."""
    if job.spec.input.id_key is None:
        return None
    count, examples = 0, []
    for batch in InputReader.for_job(job, read_only=True).id_batches():
        count += len(batch.duplicates)
        examples += list(batch.duplicates.values())[:1 - len(examples)]
    return f"input.id_column: {repeated_ids(count)} (the first: {examples[0]})" if count else None


def embed_problems(raw: dict[str, Any], model: ModelSpec | None, base_dir: Path) -> list[Problem]:
    """``embed.dimensions`` beyond the hidden size in a local model's config.json."""
    embed = _part(EmbedSpec, raw.get("embed")) if raw.get("task") == "embed" else None
    if embed is None or model is None:
        return []
    hidden = (text_config(model, base_dir) or {}).get("hidden_size")
    why = dimensions_problem(embed.dimensions, hidden if isinstance(hidden, int) else None)
    return [Problem("embed.dimensions", f"{why} (its config.json)")] if why else []


_SECTIONS = ["", "model", "input", "sampling", "output", "shard", "storage"]


def _section_rank(p: Problem) -> int:
    """Problems grouped by section in job-file order (the sort is stable within a section)."""
    head = re.split(r"[.\[]", p.path, maxsplit=1)[0]
    return _SECTIONS.index(head) if head in _SECTIONS else len(_SECTIONS)


def _part(model: Any, raw: Any) -> Any:
    try:
        return model.model_validate(raw)
    except ValidationError:
        return None
