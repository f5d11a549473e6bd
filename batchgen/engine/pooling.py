"""Pooling: one vector from a request's final hidden states, read chunk by chunk as its prefill runs.

"last" keeps the last token's state (decoder embedding models, and the token transformers'
`...ForSequenceClassification` heads read), "cls" the first token's, "mean" the average over the
prompt. A mean is summed in aligned groups of `MEAN_GROUP` positions, each group in one float64 sum
and the groups in order: the result never depends on how the prompt was chunked (which the other
requests of a step decide), and only a group's rows wait in memory, not the prompt's.

A model directory saved by sentence-transformers says how it pools (`modules.json`, then the
Pooling module's `config.json`) and whether it normalises (a Normalize module): `read_pooling_config`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

MEAN_GROUP = 16

_ST_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}
_ST = "sentence_transformers.models."


@dataclass(frozen=True)
class PoolingConfig:
    """The model's own pooling: `method` and `normalize` None when it does not say; `problem` when it
    asks for what batchgen does not do (a request must then name its pooling)."""

    method: str | None = None
    normalize: bool | None = None
    problem: str | None = None


def read_pooling_config(model_dir: Path) -> PoolingConfig:
    modules_file = model_dir / "modules.json"
    if not modules_file.exists():
        return PoolingConfig()
    try:
        modules = json.loads(modules_file.read_text())
        types = {m["type"].removeprefix(_ST): m.get("path", "") for m in modules}
        pooling = json.loads((model_dir / types["Pooling"] / "config.json").read_text()) if "Pooling" in types else {}
    except (OSError, ValueError, KeyError, TypeError) as e:
        return PoolingConfig(problem=f"cannot read its sentence-transformers config ({e})")
    normalize = "Normalize" in types
    if unknown := sorted(set(types) - {"Transformer", "Pooling", "Normalize"}):
        return PoolingConfig(None, normalize, f"its sentence-transformers modules {', '.join(unknown)} are not "
                                              "supported (batchgen pools and normalises only)")
    modes = [name for name, on in pooling.items() if name.startswith("pooling_mode_") and on]
    if len(modes) != 1 or modes[0] not in _ST_MODES:
        return PoolingConfig(None, normalize, f"its sentence-transformers pooling ({', '.join(modes) or 'none'}) "
                                              f"is not one of {', '.join(_ST_MODES.values())}")
    return PoolingConfig(_ST_MODES[modes[0]], normalize)


@dataclass
class Pooler:
    """One request's pooling over positions [0, num_tokens) as its chunks arrive (in order)."""

    method: str
    num_tokens: int
    next_position: int = 0
    _kept: torch.Tensor | None = None  # last / cls: the row
    _sum: torch.Tensor | None = None  # mean: float64 sum of the finished groups
    _group: list[torch.Tensor] = field(default_factory=list)  # mean: rows of the group being filled

    @property
    def _range(self) -> range:
        if self.method == "last":
            return range(self.num_tokens - 1, self.num_tokens)
        return range(0, 1) if self.method == "cls" else range(0, self.num_tokens)

    @property
    def done(self) -> bool:
        return self.next_position >= self._range.stop

    @property
    def hidden_from(self) -> int | None:
        return None if self.done else max(self.next_position, self._range.start)

    def wanted(self, start: int, end: int) -> range:
        return range(max(start, self.next_position, self._range.start), min(end, self._range.stop))

    def add(self, rows: torch.Tensor, positions: range) -> None:
        """The final hidden states of `positions` (what `wanted` gave), in order."""
        assert positions.start == max(self.next_position, self._range.start) and len(rows) == len(positions)
        self.next_position = positions.stop
        if self.method != "mean":
            self._kept = rows[-1].float().clone()
            return
        done = 0
        while done < len(rows):
            position = positions.start + done
            take = min(len(rows) - done, MEAN_GROUP - position % MEAN_GROUP)
            self._group.append(rows[done:done + take].double())  # a copy: the step's hidden states are let go
            done += take
            if (position + take) % MEAN_GROUP == 0 or position + take == self.num_tokens:
                group_sum = torch.cat(self._group).sum(dim=0)
                self._sum = group_sum if self._sum is None else self._sum + group_sum
                self._group.clear()

    def reset(self) -> None:
        self.next_position, self._kept, self._sum = 0, None, None
        self._group.clear()

    def result(self) -> torch.Tensor:
        """The pooled float32 vector."""
        assert self.done, "pooled before the prompt was computed"
        if self.method == "mean":
            return (self._sum / self.num_tokens).float()
        return self._kept


def embedding(pooled: torch.Tensor, dimensions: int | None, normalize: bool) -> list[float]:
    vector = pooled[:dimensions] if dimensions else pooled
    return (F.normalize(vector, dim=-1) if normalize else vector).tolist()


def class_probs(logits: torch.Tensor, activation: bool) -> torch.Tensor:
    """Probabilities of a classifier's logits: softmax, or a sigmoid for one label (a reward model's score)."""
    if not activation:
        return logits
    return torch.sigmoid(logits) if logits.numel() == 1 else torch.softmax(logits, dim=-1)
