"""OpenAI Batch response lines (``output.format: openai_batch``); the request lines are read by
``inputs/openai_batch.py``.

A response line is ``{"id", "custom_id", "response": {"status_code", "request_id", "body"},
"error"}`` whose body is a ``chat.completion`` or ``text_completion`` object with every sample
in ``choices``, or for an embeddings request a ``list`` of ``embedding`` objects (OpenAI's
CreateEmbeddingResponse; ``encoding_format: base64`` gives each vector as the base64 of its
little-endian float32 bytes); a failed row has ``"response": null`` and ``"error": {"code", "message"}``.
"""

from __future__ import annotations

import base64
import hashlib
import time
from typing import Any

import numpy as np

from ...outputs import PoolingRequestOutput, RequestOutput
from ..inputs.rows import CHAT, Row

_UNKNOWN_LOGPROB = -9999.0  # what OpenAI writes for a token outside the computed top logprobs


def _digest(row_id: str) -> str:
    return hashlib.sha256(row_id.encode("utf-8", "surrogatepass")).hexdigest()[:24]


class ResponseLines:
    """Builds the output line of a finished or failed row."""

    def __init__(self, model: str, tokenizer: Any = None, default_logprobs: int | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.default_logprobs = default_logprobs
        self._texts: dict[int, str] = {}  # token id -> its text, decoded once

    def result(self, row: Row, outputs: list[RequestOutput | PoolingRequestOutput]) -> list[dict[str, Any]]:
        """``outputs``: the engine's output of each of the row's requests (an embeddings request has one
        per input)."""
        if isinstance(outputs[0], PoolingRequestOutput):  # a /v1/embeddings request, or a row of an embed job
            return self._line(row, self._embeddings(row, outputs))
        out = outputs[0]
        chat = row.endpoint == CHAT
        top = row.top_logprobs if row.top_logprobs is not None else self.default_logprobs
        echo = bool(row.options.get("echo"))
        prompt_text = self._prompt_text(out) if echo else ""
        choices = []
        for c in sorted(out.outputs, key=lambda c: c.index):
            choice: dict[str, Any] = {"index": c.index, "finish_reason": c.finish_reason}
            if chat:
                choice["message"] = {"role": "assistant", "content": c.text}
            else:
                choice["text"] = prompt_text + c.text
            choice["logprobs"] = None if c.logprobs is None else self._logprobs(c.token_ids, c.logprobs, top, chat)
            if echo and choice["logprobs"] is not None:
                choice["logprobs"] = self._echoed(out, choice["logprobs"], top)
            choices.append(choice)
        prompt_tokens = len(out.prompt_token_ids)
        completion_tokens = sum(len(c.token_ids) for c in out.outputs)
        body = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{_digest(row.id)}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": row.lora or self.model,
            "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens},
        }
        return self._line(row, body)

    @staticmethod
    def _line(row: Row, body: dict[str, Any]) -> list[dict[str, Any]]:
        digest = _digest(row.id)
        return [{"id": f"batch_req_{digest}", "custom_id": row.id,
                 "response": {"status_code": 200, "request_id": f"req_{digest}", "body": body}, "error": None}]

    def _embeddings(self, row: Row, outputs: list[PoolingRequestOutput]) -> dict[str, Any]:
        base64_format = row.options.get("encoding_format") == "base64"
        data = []
        for i, out in enumerate(outputs):
            vector = out.outputs.embedding
            if base64_format:
                vector = base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
            data.append({"object": "embedding", "index": i, "embedding": vector})
        tokens = sum(len(out.prompt_token_ids) for out in outputs)
        return {"object": "list", "data": data, "model": row.lora or self.model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    def _prompt_text(self, out: RequestOutput) -> str:
        if out.prompt is not None:
            return out.prompt
        return "" if self.tokenizer is None else self.tokenizer.decode(out.prompt_token_ids)

    def _echoed(self, out: RequestOutput, logprobs: dict[str, Any], top: int | None) -> dict[str, Any]:
        """The completions logprobs with the prompt's tokens in front, as OpenAI's echo gives them: the
        first token has no logprob (nothing comes before it)."""
        ids = out.prompt_token_ids
        tokens = [self._token(t) for t in ids]
        values: list[float | None] = [None]
        tops: list[dict[str, float] | None] = [None]
        for tid, entry in zip(ids[1:], (out.prompt_logprobs or [None])[1:], strict=True):
            values.append(entry.get(tid, _UNKNOWN_LOGPROB))
            tops.append(self._top_by_text(sorted(entry.items(), key=lambda kv: -kv[1])[:top or 0]))
        offsets, at = [], 0
        for t in [*tokens, *logprobs["tokens"]]:
            offsets.append(at)
            at += len(t)
        return {"tokens": tokens + logprobs["tokens"], "token_logprobs": values + logprobs["token_logprobs"],
                "top_logprobs": tops + logprobs["top_logprobs"], "text_offset": offsets}

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
