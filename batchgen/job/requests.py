"""What a row asks of the engine: one request per row (generate, score, embed, classify), or one per
input of an OpenAI embeddings request (the row's prompt is then the list of its inputs)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..pooling_params import PoolingParams, ScoringParams
from .inputs import Row
from .inputs.rows import EMBEDDING
from .params import ParamsBuilder
from .spec import JobSpec
from .tasks import EmbedSpec, ScoreSpec


@dataclass
class EngineRequest:
    prompt: Any
    params: Any  # SamplingParams, BeamSearchParams, ScoringParams or PoolingParams
    completion: str | list[int] | None = None  # a scoring request's


class RequestBuilder:
    """The engine requests of a row, from the job's task and options (``RowParamsError`` for a row
    whose own values cannot be served)."""

    def __init__(self, spec: JobSpec):
        self.task = spec.task
        self.sampling = ParamsBuilder(spec.sampling)
        self.scoring = ScoringParams(token_logprobs=(spec.score or ScoreSpec()).token_logprobs)
        embed = spec.embed or EmbedSpec()
        self.embed = PoolingParams("embed", pooling=embed.pooling, normalize=embed.normalize,
                                   dimensions=embed.dimensions)

    def for_row(self, row: Row) -> list[EngineRequest]:
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
