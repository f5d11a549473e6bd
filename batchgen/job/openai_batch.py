"""The OpenAI Batch file format: request lines in (``input.format: openai_batch``), response
lines out (``output.format: openai_batch``).

A request line is ``{"custom_id", "method": "POST", "url", "body"}`` with ``url``
``/v1/chat/completions`` (``body.messages``) or ``/v1/completions`` (``body.prompt``). The
body's sampling fields become the row's overrides of the job's ``sampling``; SamplingParams
field names are accepted too (``top_k``, ``min_tokens``, ... as vLLM's server does). Fields that
change nothing here (``stream``, ``user``, ``logit_bias``, ...) are ignored and counted.

A response line is ``{"id", "custom_id", "response": {"status_code", "request_id", "body"},
"error"}`` whose body is a ``chat.completion`` or ``text_completion`` object with every sample
in ``choices``; a failed row has ``"response": null`` and ``"error": {"code", "message"}``.
"""

from __future__ import annotations

import hashlib
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..outputs import RequestOutput
from ..sampling_params import SamplingParams

if TYPE_CHECKING:
    from .inputs.reader import Row

CHAT = "chat"
COMPLETION = "completion"
ENDPOINTS = {"/v1/chat/completions": CHAT, "/v1/completions": COMPLETION}
# Body fields named as SamplingParams fields (max_tokens, temperature, top_p, n, stop, seed, the
# penalties; and vLLM's extras such as top_k, min_tokens): the row's overrides as they are.
_NATIVE = frozenset(SamplingParams.field_names()) - {"logprobs"}
_UNKNOWN_LOGPROB = -9999.0  # what OpenAI writes for a token outside the computed top logprobs


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

    @property
    def prompt_field(self) -> str:
        return "body.messages" if self.endpoint == CHAT else "body.prompt"


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
    prompt_key = "messages" if endpoint == CHAT else "prompt"
    req = BatchRequest(endpoint, _prompt(endpoint, body.get(prompt_key)))
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError(f"field 'body.model': expected a string, got {type(model).__name__}")
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
    """Chat content given as a list of text parts becomes one string (parts joined by newlines)."""
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
            texts = []
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text" or not isinstance(part.get("text"), str):
                    raise RequestError(f"field 'body.messages': message [{i}].content: only text parts are "
                                       f"supported, got {kind or type(part).__name__!r}")
                texts.append(part["text"])
            m = {**m, "content": "\n".join(texts)}
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


# ------------------------------------------------------------------------------------- output


def _digest(row_id: str) -> str:
    return hashlib.sha256(row_id.encode("utf-8", "surrogatepass")).hexdigest()[:24]


class ResponseLines:
    """Builds the output line of a finished or failed row."""

    def __init__(self, model: str, tokenizer: Any = None, default_logprobs: int | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.default_logprobs = default_logprobs
        self._texts: dict[int, str] = {}  # token id -> its text, decoded once

    def result(self, row: Row, out: RequestOutput) -> list[dict[str, Any]]:
        chat = row.endpoint == CHAT
        top = row.top_logprobs if row.top_logprobs is not None else self.default_logprobs
        choices = []
        for c in sorted(out.outputs, key=lambda c: c.index):
            choice: dict[str, Any] = {"index": c.index, "finish_reason": c.finish_reason}
            if chat:
                choice["message"] = {"role": "assistant", "content": c.text}
            else:
                choice["text"] = c.text
            choice["logprobs"] = None if c.logprobs is None else self._logprobs(c.token_ids, c.logprobs, top, chat)
            choices.append(choice)
        prompt_tokens = len(out.prompt_token_ids)
        completion_tokens = sum(len(c.token_ids) for c in out.outputs)
        digest = _digest(row.id)
        body = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{digest}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens},
        }
        return [{"id": f"batch_req_{digest}", "custom_id": row.id,
                 "response": {"status_code": 200, "request_id": f"req_{digest}", "body": body}, "error": None}]

    @staticmethod
    def error(row: Row, message: str, code: str) -> list[dict[str, Any]]:
        return [{"id": f"batch_req_{_digest(row.id)}", "custom_id": row.id, "response": None,
                 "error": {"code": code, "message": message}}]

    def _token(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = f"token_id:{token_id}" if self.tokenizer is None else self.tokenizer.decode([token_id])
            self._texts[token_id] = text
        return text

    def _top_by_text(self, best: list[tuple[int, float]]) -> dict[str, float]:
        """The completions format keys top logprobs by token text; where two tokens decode to the
        same text (byte pieces of one character), the likelier one is kept."""
        out: dict[str, float] = {}
        for t, v in best:
            out.setdefault(self._token(t), v)
        return out

    def _logprobs(self, token_ids: list[int], logprobs: list[dict[int, float]], top: int | None,
                  chat: bool) -> dict[str, Any]:
        k = top or 0
        entries = []
        for tid, lps in zip(token_ids, logprobs, strict=False):
            best = sorted(lps.items(), key=lambda kv: -kv[1])[:k]
            entries.append((tid, lps.get(tid, _UNKNOWN_LOGPROB), best))
        if chat:
            def item(tid: int, lp: float) -> dict[str, Any]:
                text = self._token(tid)
                return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8", "replace"))}

            content = [{**item(tid, lp), "top_logprobs": [item(t, v) for t, v in best]} for tid, lp, best in entries]
            return {"content": content, "refusal": None}
        tokens = [self._token(tid) for tid, _, _ in entries]
        offsets, at = [], 0
        for t in tokens:
            offsets.append(at)
            at += len(t)
        return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in entries],
                "top_logprobs": [self._top_by_text(best) for _, _, best in entries],
                "text_offset": offsets}
