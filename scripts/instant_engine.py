"""An engine that costs nothing: every request finishes at the next step with one token, so a
job run on it measures the job layer alone (reading, bookkeeping, writing parts).

    batchgen run job.yaml --engine scripts/instant_engine.py:InstantLLM

Used by ``scripts/bench_jobs.py`` and the job-scale tests; the model directory only has to exist.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from batchgen.outputs import CompletionOutput, RequestOutput


class InstantLLM:
    def __init__(self, model: str, **options: Any):
        if not Path(model).is_dir():
            raise FileNotFoundError(f"model directory not found: {model}")
        self.model_name = Path(model).name
        self.max_model_len = 1 << 20
        self.tokenizer = None
        self._pending: list[tuple[str, Any]] = []

    def add_request(self, request_id: str, prompt: Any, params: Any, **kwargs: Any) -> None:
        self._pending.append((request_id, prompt))

    def step(self) -> list[RequestOutput]:
        done, self._pending = self._pending, []
        return [self._output(request_id, prompt) for request_id, prompt in done]

    @staticmethod
    def _output(request_id: str, prompt: Any) -> RequestOutput:
        text = prompt if isinstance(prompt, str) else None
        sample = CompletionOutput(index=0, text="x", token_ids=[0], finish_reason="length")
        return RequestOutput(request_id, text, [0], [sample])

    def has_unfinished_requests(self) -> bool:
        return bool(self._pending)

    def num_unfinished_requests(self) -> int:
        return len(self._pending)

    def stats(self) -> dict[str, Any]:
        return {}
