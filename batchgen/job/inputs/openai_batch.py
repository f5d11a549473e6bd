"""OpenAI Batch request files (``input.format: openai_batch``): JSONL lines of
``{"custom_id", "method": "POST", "url", "body"}`` with ``url`` ``/v1/chat/completions``
(``body.messages``), ``/v1/completions`` (``body.prompt``) or ``/v1/embeddings`` (``body.input``: a text,
token ids, or a list of either; ``encoding_format``, ``dimensions``).

The body's sampling fields become the row's overrides of the job's ``sampling``; SamplingParams
field names are accepted too (``top_k``, ``min_tokens``, ... as vLLM's server does). Fields that
change nothing here (``stream``, ``user``, ``logit_bias``, ...) are ignored and counted. A completions
request with ``echo`` gets its prompt in front of each choice's text, and with ``logprobs`` the prompt
tokens' logprobs in front of the completion's (OpenAI's legacy completions API).
The response lines are the output side's (``job/outputs/openai_batch.py``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ...sampling_params import SamplingParams
from .image_values import clean_content, content_problem
from .rows import CHAT, COMPLETION, EMBEDDING

ENDPOINTS = {"/v1/chat/completions": CHAT, "/v1/completions": COMPLETION, "/v1/embeddings": EMBEDDING}
ENCODING_FORMATS = ("float", "base64")
# Body fields named as SamplingParams fields (max_tokens, temperature, top_p, n, stop, seed, the
# penalties; and vLLM's extras such as top_k, min_tokens): the row's overrides as they are. Not logprobs (below),
# prompt_logprobs (echo) or detokenize (a response's content is its text).
_NATIVE = frozenset(SamplingParams.field_names()) - {"logprobs", "prompt_logprobs", "detokenize"}


class RequestError(ValueError):
    """A request line that cannot be served; its message names the field."""


@dataclass
class BatchRequest:
    endpoint: str  # CHAT | COMPLETION
    prompt: Any  # body.messages or body.prompt, as written (the reader checks its shape)
    overrides: dict[str, Any] = field(default_factory=dict)  # SamplingParams field -> value
    sources: dict[str, str] = field(default_factory=dict)  # SamplingParams field -> the body field it came from
    model: str | None = None
    ignored: list[str] = field(default_factory=list)  # body fields that change nothing here
    options: dict[str, Any] = field(default_factory=dict)  # echo; embeddings: encoding_format, dimensions

    @property
    def prompt_field(self) -> str:
        return {CHAT: "body.messages", EMBEDDING: "body.input"}.get(self.endpoint, "body.prompt")


def parse_request(obj: dict[str, Any]) -> BatchRequest:
    """The request of one line (``custom_id`` is read by the reader, as any id column)."""
    method = obj.get("method", "POST")
    if method != "POST":
        raise RequestError(f"field 'method': must be POST, got {method!r}")
    url = obj.get("url")
    if url not in ENDPOINTS:
        raise RequestError(f"field 'url': must be one of {', '.join(ENDPOINTS)}, got {url!r}")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise RequestError(f"field 'body': expected an object, got {type(body).__name__}")
    endpoint = ENDPOINTS[url]
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError(f"field 'body.model': expected a string, got {type(model).__name__}")
    if endpoint == EMBEDDING:
        return _embeddings(body, model)
    prompt_key = "messages" if endpoint == CHAT else "prompt"
    req = BatchRequest(endpoint, _prompt(endpoint, body.get(prompt_key)))
    req.model = model
    for key, value in body.items():
        if key in (prompt_key, "model") or value is None:
            continue
        if key in _NATIVE:
            req.overrides[key] = value
            req.sources[key] = f"body.{key}"
        elif key == "max_completion_tokens" and endpoint == CHAT:
            req.overrides["max_tokens"] = value
            req.sources["max_tokens"] = "body.max_completion_tokens"
        elif key in ("logprobs", "top_logprobs"):
            continue  # below
        elif key == "echo" and endpoint == COMPLETION:
            if not isinstance(value, bool):
                raise RequestError(f"field 'body.echo': expected true or false, got {value!r}")
            req.options["echo"] = value
        elif key == "response_format":
            constraint = _response_format(value)
            if constraint is not None:
                req.overrides["structured_outputs"] = constraint
                req.sources["structured_outputs"] = "body.response_format"
        else:
            req.ignored.append(key)
    _logprobs(endpoint, body, req)
    return req


def _prompt(endpoint: str, value: Any) -> Any:
    """Chat content given as a list of text parts becomes one string (parts joined by newlines); a list
    with image parts (``image_url``: a data URL, a path or a bucket URL) stays a list, its images loaded
    when the row is prepared (``job/images.py``)."""
    if endpoint == COMPLETION:
        if isinstance(value, list) and value and all(isinstance(p, str) for p in value):
            raise RequestError("field 'body.prompt': one prompt per line (a list of strings is a batch)")
        return value
    if not isinstance(value, list):
        return value
    out = []
    for i, m in enumerate(value):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            if why := content_problem(i, content):
                raise RequestError(f"field 'body.messages': {why}")
            m = {**m, "content": clean_content(content)}
        out.append(m)
    return out


def _response_format(value: Any) -> dict[str, Any] | None:
    """``response_format`` as a structured-outputs constraint (None: plain text)."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise RequestError("field 'body.response_format.json_schema.schema': expected a JSON schema object")
        return {"json": schema}
    raise RequestError(f"field 'body.response_format': type must be text, json_object or json_schema, got {kind!r}")


def _logprobs(endpoint: str, body: dict[str, Any], req: BatchRequest) -> None:
    """Chat: ``logprobs: true`` and ``top_logprobs: k``; completions: ``logprobs: k``."""
    asked, top = body.get("logprobs"), body.get("top_logprobs")
    if endpoint == COMPLETION:
        if top is not None:
            req.ignored.append("top_logprobs")
        if asked is not None:
            req.overrides["logprobs"], req.sources["logprobs"] = asked, "body.logprobs"
            if req.options.get("echo"):  # the prompt's tokens come back with theirs
                req.overrides["prompt_logprobs"], req.sources["prompt_logprobs"] = asked, "body.logprobs"
        return
    if asked is not None and not isinstance(asked, bool):
        raise RequestError(f"field 'body.logprobs': expected true or false, got {asked!r}")
    if top is not None and not asked:
        raise RequestError("field 'body.top_logprobs': needs \"logprobs\": true")
    if asked:
        req.overrides["logprobs"] = 0 if top is None else top
        req.sources["logprobs"] = "body.top_logprobs" if top is not None else "body.logprobs"


def ignored_summary(counts: Counter[str]) -> str | None:
    if not counts:
        return None
    listed = ", ".join(f"{k} ({n:,} rows)" for k, n in counts.most_common())
    return f"openai_batch: body fields ignored (they change nothing here): {listed}"


def _embeddings(body: dict[str, Any], model: str | None) -> BatchRequest:
    """An embeddings request: its inputs as a list (one text or token-id list is a list of one)."""
    value = body.get("input")
    one = isinstance(value, str) or (isinstance(value, list) and value and all(isinstance(t, int) for t in value))
    if one:
        inputs = [value]
    elif isinstance(value, list) and value:
        inputs = value
    else:
        raise RequestError("field 'body.input': expected a text, token ids, or a non-empty list of either, "
                           f"got {value!r:.40}")
    req = BatchRequest(EMBEDDING, inputs, model=model)
    encoding = body.get("encoding_format", "float")
    if encoding not in ENCODING_FORMATS:
        raise RequestError(f"field 'body.encoding_format': must be float or base64, got {encoding!r}")
    dimensions = body.get("dimensions")
    if dimensions is not None and (isinstance(dimensions, bool) or not isinstance(dimensions, int) or dimensions < 1):
        raise RequestError(f"field 'body.dimensions': expected an integer >= 1, got {dimensions!r}")
    req.options = {"encoding_format": encoding, "dimensions": dimensions}
    req.ignored = [k for k, v in body.items() if k not in ("input", "model", "encoding_format", "dimensions")
                   and v is not None]
    return req
