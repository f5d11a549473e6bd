"""PoolingParams (embeddings, classifiers) and ScoringParams (log-likelihood of a given completion)."""

from __future__ import annotations

from dataclasses import dataclass

POOLING_TASKS = ("embed", "classify")
POOLING_METHODS = ("last", "mean", "cls")


@dataclass
class PoolingParams:
    """One request that is prefilled and pooled, never sampled (vLLM's `PoolingParams`).

    `task` "embed": the pooled final hidden state, truncated to `dimensions` (Matryoshka models)
    and L2-normalised when `normalize`. "classify": the model's classification head on the pooled
    state; `activation` turns its logits into probabilities (softmax, sigmoid for one label).
    `pooling` / `normalize` None follow the model's sentence-transformers config when it has one,
    else "last" and True (vLLM's defaults for decoder models).
    """

    task: str = "embed"
    pooling: str | None = None
    normalize: bool | None = None
    dimensions: int | None = None
    activation: bool = True

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"PoolingParams.{name}: {why} (got {getattr(self, name)!r})")

        if self.task not in POOLING_TASKS:
            raise bad("task", f"must be one of {', '.join(POOLING_TASKS)}")
        if self.pooling is not None and self.pooling not in POOLING_METHODS:
            raise bad("pooling", f"must be one of {', '.join(POOLING_METHODS)} or None (the model's own)")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise bad("normalize", "must be true, false or None")
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise bad("dimensions", "must be an integer >= 1 or None")
        if self.task != "embed" and self.dimensions is not None:
            raise bad("dimensions", "applies to task embed only")
        if not isinstance(self.activation, bool):
            raise bad("activation", "must be true or false")


@dataclass
class ScoringParams:
    """How to score a given completion after a prompt: its tokens' logprobs under the model, from
    the prompt's prefill (nothing is sampled). `logprobs`: the top k alternatives per completion token
    as well (None: none); `token_logprobs`: return each completion token's logprob, not only the sums."""

    logprobs: int | None = None
    token_logprobs: bool = False

    def __post_init__(self) -> None:
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or self.logprobs < 0):
            raise ValueError(f"ScoringParams.logprobs: must be an integer >= 0 or None (got {self.logprobs!r})")
        if not isinstance(self.token_logprobs, bool):
            raise ValueError(f"ScoringParams.token_logprobs: must be true or false (got {self.token_logprobs!r})")
