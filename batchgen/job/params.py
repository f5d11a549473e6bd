"""SamplingParams for each row: the job's sampling section, per-row overrides, per-row seeds."""

from __future__ import annotations

import dataclasses
from typing import Any

from pydantic import ValidationError

from ..sampling_params import SamplingParams
from .shard import row_seed
from .spec import SamplingSpec


class RowParamsError(ValueError):
    """An override column holds a value SamplingParams refuses; the row becomes an error row."""


class ParamsBuilder:
    """Builds a row's SamplingParams.

    When the job sets ``sampling.seed``, each row gets its own seed derived from the job seed and
    the row id, so a row samples the same text whatever batch it lands in and in whichever run
    (resume, other shard). A ``seed`` override column wins over the derived seed.
    """

    def __init__(self, spec: Any):
        self.spec = spec
        self.base = spec.params()
        self.job_seed: int | None = spec.seed
        self._defaults = spec.model_dump()

    def for_row(self, row_id: str, overrides: dict[str, Any], sources: dict[str, str] | None = None
                ) -> SamplingParams:
        """``sources``: where an override came from when it is not a column (``body.max_tokens``)."""
        changes: dict[str, Any] = {}
        if self.job_seed is not None and "seed" not in overrides:
            changes["seed"] = row_seed(self.job_seed, row_id)
        if not overrides:
            return dataclasses.replace(self.base, **changes)
        try:
            merged = SamplingSpec.model_validate({**self._defaults, **overrides})
        except ValidationError as e:
            err = e.errors()[0]
            key = str(err["loc"][0]) if err["loc"] else "?"
            raise RowParamsError(self._where(key, f"{err['msg'].removeprefix('Value error, ')} "
                                                  f"(got {overrides.get(key)!r})", sources)) from None
        try:
            return merged.params(**changes)
        except (ValueError, TypeError) as e:
            msg = str(e)
            key = msg.split(":", 1)[0].removeprefix("SamplingParams.")
            raise RowParamsError(self._where(key, msg.split(": ", 1)[-1], sources)) from None

    def _where(self, key: str, msg: str, sources: dict[str, str] | None) -> str:
        if sources and key in sources:
            return f"field {sources[key]!r}: {msg}"
        col = self.spec.overrides.get(key)
        return f"field {col!r} (sampling.{key} override): {msg}" if col else f"sampling: {msg}"
