"""What a row asks of the engine: one request per row (generate, score, embed, classify), or one per
input of an OpenAI embeddings request (the row's prompt is then the list of its inputs)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..lora.request import LoRARequest
from ..pooling_params import PoolingParams, ScoringParams
from .adapters import JobAdapter, UnknownAdapter, pick_adapter
from .inputs import Row
from .inputs.rows import EMBEDDING
from .params import ParamsBuilder, RowParamsError
from .spec import JobSpec
from .tasks import EmbedSpec, ScoreSpec


@dataclass
class EngineRequest:
    prompt: Any
    params: Any  # SamplingParams, BeamSearchParams, ScoringParams or PoolingParams
    completion: str | list[int] | None = None  # a scoring request's
    lora: LoRARequest | None = None  # the adapter it runs with (None: the base model)


class RequestBuilder:
    """The engine requests of a row, from the job's task and options (``RowParamsError`` for a row
    whose own values cannot be served, or that names an adapter the job does not have)."""

    def __init__(self, spec: JobSpec, adapters: dict[str, JobAdapter] | None = None, detokenize: bool = True):
        """``detokenize``: the generation requests' SamplingParams.detokenize (texts.TextPlan)."""
        self.task = spec.task
        self.adapters = adapters or {}
        self.job_lora = spec.sampling.lora
        self.sampling = ParamsBuilder(spec.sampling, detokenize)
        self.scoring = ScoringParams(token_logprobs=(spec.score or ScoreSpec()).token_logprobs)
        embed = spec.embed or EmbedSpec()
        self.embed = PoolingParams("embed", pooling=embed.pooling, normalize=embed.normalize,
                                   dimensions=embed.dimensions)

    def for_row(self, row: Row) -> list[EngineRequest]:
        requests = self._requests(row)
        adapter = self.adapter_of(row)
        if adapter is not None:
            for request in requests:
                request.lora = adapter.request
        return requests

    def adapter_of(self, row: Row) -> JobAdapter | None:
        """The row's adapter: the one it names (input.lora_column, body.model; none there is the base
        model), else the job's sampling.lora."""
        try:
            return pick_adapter(self.adapters, row.lora if row.lora_field else self.job_lora)
        except UnknownAdapter as e:
            raise RowParamsError(f"field {row.lora_field!r}: {e}") from None

    def _requests(self, row: Row) -> list[EngineRequest]:
        if row.endpoint == EMBEDDING:
            params = PoolingParams("embed", dimensions=row.options.get("dimensions"))
            return [EngineRequest(one, params) for one in row.prompt]
        if self.task == "score":
            return [EngineRequest(row.prompt, self.scoring, row.completion)]
        if self.task == "embed":
            return [EngineRequest(row.prompt, self.embed)]
        if self.task == "classify":
            return [EngineRequest(row.prompt, PoolingParams("classify"))]
        return [EngineRequest(row.prompt, self.sampling.for_row(row.id, row.overrides, row.sources))]
