"""SamplingParams for each row: the job's sampling section, per-row overrides, per-row seeds."""

from __future__ import annotations

import copy
from typing import Any

from pydantic import ValidationError

from ..sampling_params import SamplingParams
from .shard import row_seed
from .spec import SamplingSpec
from .structured import row_constraint


class RowParamsError(ValueError):
    """An override column holds a value SamplingParams refuses; the row becomes an error row."""


class ParamsBuilder:
    """Builds a row's SamplingParams.

    When the job sets ``sampling.seed``, each row gets its own seed derived from the job seed and
    the row id, so a row samples the same text whatever batch it lands in and in whichever run
    (resume, other shard). A ``seed`` override column wins over the derived seed.
    """

    def __init__(self, spec: Any, detokenize: bool = True):
        """``detokenize``: False where the engine's text is not needed (texts.TextPlan; no row overrides what
        would need it)."""
        self.spec = spec
        self._changes = {} if detokenize else {"detokenize": False}
        self.base = spec.params(**self._changes)
        self.job_seed: int | None = spec.seed
        self._defaults = spec.model_dump()

    def for_row(self, row_id: str, overrides: dict[str, Any], sources: dict[str, str] | None = None
                ) -> SamplingParams:
        """``sources``: where an override came from when it is not a column (``body.max_tokens``)."""
        changes: dict[str, Any] = dict(self._changes)
        if self.job_seed is not None and "seed" not in overrides:
            changes["seed"] = row_seed(self.job_seed, row_id)
        if not overrides:
            return self._with_seed(changes.get("seed"))
        values = row_constraint(overrides)
        try:
            merged = SamplingSpec.model_validate({**self._defaults, **values})
        except ValidationError as e:
            err = e.errors()[0]
            key = ".".join(str(part) for part in err["loc"][:2]) if err["loc"] else "?"
            raise RowParamsError(self._where(key, f"{err['msg'].removeprefix('Value error, ')} "
                                                  f"(got {self._value(key, overrides)!r})", sources)) from None
        try:
            return merged.params(**changes)
        except (ValueError, TypeError) as e:
            msg = str(e)
            key = msg.split(":", 1)[0].removeprefix("SamplingParams.")
            raise RowParamsError(self._where(key, msg.split(": ", 1)[-1], sources)) from None

    def _with_seed(self, seed: int | None) -> SamplingParams:
        """The job's params, shared by the rows without overrides (the engine never changes a
        request's params, as ``LLM.generate`` shares one among its prompts), or a copy with a row's
        seed: no per-row validation of what the job file's check validated once."""
        if seed is None:
            return self.base
        params = copy.copy(self.base)
        params.seed = seed
        return params

    def _override_key(self, key: str) -> str | None:
        """The override column behind a field path: itself, the field above it, or, for a field
        with parts (``structured_outputs``), the one part overridden."""
        head = key.split(".", 1)[0]
        parts = [k for k in self.spec.overrides if k.startswith(head + ".")]
        for candidate in (key, head, *(parts if len(parts) == 1 else [])):
            if candidate in self.spec.overrides:
                return candidate
        return None

    def _value(self, key: str, overrides: dict[str, Any]) -> Any:
        found = self._override_key(key) or key.split(".", 1)[0]
        return overrides.get(found)

    def _where(self, key: str, msg: str, sources: dict[str, str] | None) -> str:
        head = key.split(".", 1)[0]
        source = (sources or {}).get(key) or (sources or {}).get(head)
        if source:  # not a column: e.g. an OpenAI batch request's body field
            return f"field {source!r}: {msg}"
        found = self._override_key(key)
        if found is None:
            return f"sampling: {msg}"
        return f"field {self.spec.overrides[found]!r} (sampling.{found} override): {msg}"
