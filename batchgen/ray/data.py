"""``batchgen.ray.generate``: a Ray Data stage that generates for every row of a Dataset.

Each of ``concurrency`` actors holds one ``LLM``. The actor's ``__call__`` is async, so Ray Data
hands it several batches at once (``max_concurrent_batches``): every batch adds its rows to the
same engine and waits for them, while one stepping loop runs the engine for all of them. Rows of
different batches therefore share steps (continuous batching across Ray's batches), instead of
one ``generate`` call per batch that drains to a single straggler before the next starts.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from typing import Any

import pyarrow as pa

from ..outputs import RequestOutput
from ..sampling_params import SamplingParams
from .cluster import import_ray


def generate(ds: Any, model: str, sampling: SamplingParams | dict[str, Any] | None = None, *,
             prompt_column: str | None = "prompt", messages_column: str | None = None, concurrency: int = 1,
             batch_size: int = 64, max_concurrent_batches: int = 4, num_cpus: float = 1.0,
             num_gpus: float = 0.0, **llm_options: Any) -> Any:
    """A Dataset with ``ds``'s columns plus ``text``, ``finish_reason``, ``num_prompt_tokens``,
    ``num_output_tokens`` and ``error`` (a row that cannot be generated has ``error`` set and
    the others null). With ``sampling.n > 1``, ``text``, ``finish_reason`` and
    ``num_output_tokens`` hold a list, one item per sample. ``llm_options`` go to ``LLM`` (dtype,
    kv_cache_memory, max_model_len, ...). A seeded ``sampling`` gives the text ``LLM.generate``
    gives for the same prompts, whichever actor and batch a row lands in."""
    if (prompt_column is None) == (messages_column is None):
        raise ValueError("give exactly one of prompt_column (text or token ids) or messages_column (chat)")
    params = SamplingParams(**sampling) if isinstance(sampling, dict) else (sampling or SamplingParams())
    ray = import_ray()
    pool = ray.data.ActorPoolStrategy(size=concurrency, max_tasks_in_flight_per_actor=max_concurrent_batches,
                                      max_concurrent_calls_per_actor=max_concurrent_batches)
    return ds.map_batches(
        _Generator, batch_format="pyarrow", batch_size=batch_size, compute=pool, num_cpus=num_cpus,
        num_gpus=num_gpus, fn_constructor_kwargs={
            "model": model, "params": params, "column": prompt_column or messages_column, "llm_options": llm_options})


class _Generator:
    def __init__(self, model: str, params: SamplingParams, column: str, llm_options: dict[str, Any]):
        from .. import LLM

        self.llm = LLM(model, **llm_options)
        self.params = params
        self.column = column
        self._waiting: dict[str, asyncio.Future[RequestOutput]] = {}
        self._ids = itertools.count()
        self._stepper: asyncio.Task[None] | None = None

    async def __call__(self, batch: pa.Table) -> AsyncIterator[pa.Table]:
        loop = asyncio.get_running_loop()
        results: list[asyncio.Future[RequestOutput] | str] = []
        for prompt in batch.column(self.column).to_pylist():
            request_id = f"ray-{next(self._ids)}"
            try:
                self.llm.add_request(request_id, prompt, self.params)
            except (ValueError, TypeError) as e:
                results.append(str(e))
                continue
            self._waiting[request_id] = loop.create_future()
            results.append(self._waiting[request_id])
        if self._stepper is None or self._stepper.done():
            self._stepper = loop.create_task(self._step_until_idle())
        outputs = [r if isinstance(r, str) else await r for r in results]
        yield _with_outputs(batch, outputs, self.params.n)

    async def _step_until_idle(self) -> None:
        """Steps the engine while any batch waits; yields to the loop between steps so other
        batches can add their rows."""
        try:
            while self._waiting:
                for out in self.llm.step():
                    future = self._waiting.pop(out.request_id, None)
                    if future is not None and not future.done():
                        future.set_result(out)
                await asyncio.sleep(0)
        except Exception as e:  # the engine failed: every waiting batch fails with it
            for future in self._waiting.values():
                future.set_exception(e)
            self._waiting.clear()


def _with_outputs(batch: pa.Table, outputs: list[RequestOutput | str], n: int) -> pa.Table:
    def per_sample(out: RequestOutput, get: Any) -> Any:
        values = [get(c) for c in sorted(out.outputs, key=lambda c: c.index)]
        return values[0] if n == 1 else values

    columns: dict[str, list[Any]] = {k: [] for k in ("text", "finish_reason", "num_prompt_tokens",
                                                     "num_output_tokens", "error")}
    for out in outputs:
        error = out if isinstance(out, str) else (out.error or (None if out.outputs else "no samples"))
        ok = error is None and not isinstance(out, str)
        columns["text"].append(per_sample(out, lambda c: c.text) if ok else None)
        columns["finish_reason"].append(per_sample(out, lambda c: c.finish_reason) if ok else None)
        columns["num_output_tokens"].append(per_sample(out, lambda c: len(c.token_ids)) if ok else None)
        columns["num_prompt_tokens"].append(len(out.prompt_token_ids) if ok else None)
        columns["error"].append(error)
    listed = (lambda t: t) if n == 1 else pa.list_
    types = {"text": listed(pa.string()), "finish_reason": listed(pa.string()), "num_prompt_tokens": pa.int32(),
             "num_output_tokens": listed(pa.int32()), "error": pa.string()}
    for name, values in columns.items():
        batch = batch.append_column(name, pa.array(values, types[name]))
    return batch
