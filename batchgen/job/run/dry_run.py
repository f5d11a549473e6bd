"""``batchgen run --dry-run``: what a run would do, read-only. The job is validated as a run validates
it, the rows are counted, the first rows' prompt tokens are counted (with the model's tokenizer where
the model is here, else estimated from their length) and the KV cache a full step needs is worked out
from the model's config.json; no model is loaded, nothing is generated, nothing is written."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...config import parse_bytes
from ..images import as_placeholders, image_count
from ..inputs import InputReader
from ..inputs.rows import CHAT
from ..outputs.saved import changes_since, read_saved
from ..shard import Shard
from ..spec import Job
from ..validate import context_length, text_config
from .progress import plural
from .runner import shard_total
from .status import collect

SAMPLED_ROWS = 1000  # rows whose prompts are counted; the rest are estimated from them
CHARS_PER_TOKEN = 4  # the estimate without a tokenizer
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass
class DryRun:
    job: Job
    shard: Shard
    total: int | None  # rows of this shard in the input (None: not known without reading them all)
    exact: bool
    done: int  # rows of this shard done in the output dir already
    prompt_tokens: list[int]  # of the first rows to do (SAMPLED_ROWS at most)
    counted_by: str  # how prompt tokens were counted
    errors: int = 0  # of those rows, the ones that would be error rows
    images: int = 0  # of those rows, the images they bring (their tokens are not in prompt_tokens)
    first_error: str | None = None
    kv_bytes_per_token: int | None = None
    refusal: str | None = None  # why the run would refuse the output dir

    @property
    def to_do(self) -> int | None:
        return None if self.total is None else max(self.total - self.done, 0)


def dry_run(job: Job, shard: Shard, limit: int | None = None) -> DryRun:
    """The plan of a run of ``job``'s ``shard`` (``limit``: its first rows only)."""
    reader = InputReader.for_job(job, read_only=True)
    total, exact = shard_total(reader, shard, limit)
    done, refusal = _done_rows(job, shard)
    count, counted_by = prompt_counter(job)
    plan = DryRun(job, shard, total, exact, done, [], counted_by, kv_bytes_per_token=kv_bytes_per_token(job),
                  refusal=refusal)
    for row in itertools.islice(reader.rows(shard, limit=limit), SAMPLED_ROWS):
        if row.error:
            plan.errors += 1
            plan.first_error = plan.first_error or row.error
        else:
            images = image_count(row)
            plan.images += images
            prompt = as_placeholders(row.prompt) if images and row.endpoint == CHAT else row.prompt
            plan.prompt_tokens.append(count(prompt) + (count(row.completion) if row.completion else 0))
    return plan


def _done_rows(job: Job, shard: Shard) -> tuple[int, str | None]:
    """Rows of ``shard`` done in the output dir, and why a run would refuse that dir (another configuration)."""
    saved = read_saved(job.output_dir) if job.output_dir.is_dir() else None
    if saved is None:
        return 0, None
    refusal = None
    if saved.get("config_hash") != job.config_hash:
        refusal = (f"{job.output_dir} holds the output of another job configuration ({changes_since(saved, job)}); "
                   "a run refuses it without --force")
    report = collect(job.output_dir, with_input=False)
    mine = [st.rows for st in report.shards if st.shard == shard]
    return (mine[0] if mine else sum(st.rows for st in report.shards)), refusal


def prompt_counter(job: Job) -> tuple[Callable[[Any], int], str]:
    """How to count a prompt's tokens (text, token ids or chat messages), and how that is done: with the
    model's tokenizer where the model dir is here and has one, else by length."""
    tokenizer = _tokenizer(job)
    if tokenizer is None:
        return _estimate, f"estimated at {CHARS_PER_TOKEN} characters a token: no tokenizer of the model here"

    def count(prompt: Any) -> int:
        if isinstance(prompt, str):
            return len(tokenizer.encode(prompt, add_special_tokens=False))
        if prompt and isinstance(prompt[0], dict):
            return len(tokenizer.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True))
        return len(prompt or [])

    return count, "counted with the model's tokenizer"


def _estimate(prompt: Any) -> int:
    if isinstance(prompt, str):
        return -(-len(prompt) // CHARS_PER_TOKEN)
    if prompt and isinstance(prompt[0], dict):
        return sum(_estimate(str(m.get("content") or "")) for m in prompt)
    return len(prompt or [])


def _tokenizer(job: Job) -> Any:
    """The model's tokenizer when its directory is here (None otherwise, or when it does not load)."""
    from ...models.loader import load_tokenizer

    if job.model_source.kind != "local" or job.spec.model.skip_tokenizer_init:
        return None
    try:
        return load_tokenizer(Path(job.model_source.ref))
    except (ValueError, OSError, ImportError):
        return None


def kv_bytes_per_token(job: Job) -> int | None:
    """Key and value of one token over all layers, from the model's config.json (None: not here)."""
    config = text_config(job.spec.model, job.base_dir)
    if not config:
        return None
    try:
        heads = config["num_attention_heads"]
        kv_heads = config.get("num_key_value_heads") or heads
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        layers = config["num_hidden_layers"]
    except (KeyError, TypeError, ZeroDivisionError):
        return None
    dtype = job.spec.model.dtype
    if dtype == "auto":
        dtype = str(config.get("torch_dtype") or config.get("dtype") or "float32")
    element = 1 if job.spec.model.kv_cache_dtype != "auto" else _DTYPE_BYTES.get(dtype, 4)  # fp8: one byte
    return 2 * layers * kv_heads * head_dim * element


# ---------------------------------------------------------------------------------------- output


def render(plan: DryRun) -> str:
    """The plan as the lines ``run --dry-run`` prints."""
    job, spec = plan.job, plan.job.spec
    lines = [f"dry run: nothing is generated or written; shard {plan.shard} of {job.source or 'the job'}",
             f"  output       {job.output_dir}", f"  rows         {_rows_line(plan)}"]
    if plan.errors:
        read = plural(plan.errors + len(plan.prompt_tokens), "row")
        lines.append(f"  row errors   {plan.errors:,} of the first {read} would be error rows; "
                     f"the first: {plan.first_error}")
    lines.append(f"  prompts      {_prompt_line(plan)}")
    if spec.task == "generate":
        lines.append(f"  outputs      {_output_line(plan)}")
    if (kv := _kv_line(plan)) is not None:
        lines.append(f"  KV cache     {kv}")
    if plan.refusal:
        lines.append(f"warning: {plan.refusal}")
    return "\n".join(lines)


def _rows_line(plan: DryRun) -> str:
    if plan.total is None:
        return f"not counted (a large input without a row count); {plural(plan.done, 'row')} done before"
    approx = "" if plan.exact else "~"
    return (f"{approx}{plural(plan.total, 'row')} in the input, {plan.done:,} done before, "
            f"{approx}{plan.to_do:,} to do")


def _prompt_line(plan: DryRun) -> str:
    tokens = plan.prompt_tokens
    if not tokens:
        return f"none to read ({plan.counted_by})"
    mean = sum(tokens) / len(tokens)
    whole = "" if plan.to_do is None else f"; ~{round(mean * plan.to_do):,} tokens for the rows to do"
    images = "" if not plan.images else (f"; and {plural(plan.images, 'image')} in those rows, whose tokens (as many "
                                         "as the model gives an image) are not counted")
    return (f"{mean:,.1f} tokens a row on average, {max(tokens):,} at most (the first {plural(len(tokens), 'row')}, "
            f"{plan.counted_by}){whole}{images}")


def _output_line(plan: DryRun) -> str:
    sampling = plan.job.spec.sampling
    width = sampling.beam_width or sampling.n
    per = f"up to {sampling.max_tokens:,} tokens" if sampling.max_tokens is not None else \
        "until the context ends (no sampling.max_tokens)"
    total = "" if plan.to_do is None or sampling.max_tokens is None else \
        f"; at most {plan.to_do * width * sampling.max_tokens:,} tokens in all"
    return f"{plural(width, 'sample')} a row, {per} each{total}"


def _kv_line(plan: DryRun) -> str | None:
    """The KV cache one full step needs: ``max_num_seqs`` sequences of the longest prompt plus max_tokens."""
    per_token = plan.kv_bytes_per_token
    if per_token is None:
        return None
    model = plan.job.spec.model
    sampling = plan.job.spec.sampling
    longest = max(plan.prompt_tokens, default=0) + (sampling.max_tokens or 0)
    limit = context_length(model, plan.job.base_dir)
    if sampling.max_tokens is None and limit is not None:
        longest = limit
    if limit is not None:
        longest = min(longest, limit)
    need = per_token * longest * model.max_num_seqs
    budget = _budget(model.kv_cache_memory)
    return (f"{_size(per_token)} a token; a full step ({model.max_num_seqs:,} sequences of up to {longest:,} "
            f"tokens, model.max_num_seqs) needs up to {_size(need)}; model.kv_cache_memory {budget}")


def _budget(value: Any) -> str:
    try:
        return _size(parse_bytes(value, "kv_cache_memory"))
    except ValueError:
        return str(value)


def _size(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "bytes" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n:,.1f} GiB"
