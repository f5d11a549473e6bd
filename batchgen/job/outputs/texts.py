"""Who turns a job's output tokens into text: the engine in its loop, the part writer on its thread, or no one.

The engine decodes a finished sample's tokens between its steps. A plain generation job with no stop strings and
no constraint needs the text only in its parts, so the writer's thread can decode it instead, with a part's other
work, while the engine steps on; where the output has no ``text`` column no one decodes. Stop strings are found in
the text as it grows and the ``parsed`` column reads it, so those jobs keep the engine's text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from batchgen.engine.detokenize import decode

# Sampling fields that, overridden per row, could need the engine's text (or decode it another way).
_TEXT_FIELDS = ("stop", "structured_outputs", "detokenize", "skip_special_tokens", "spaces_between_special_tokens")


@dataclass(frozen=True)
class TextPlan:
    engine_decodes: bool = True  # the requests' SamplingParams.detokenize
    writer_decodes: bool = False  # the part writer fills the text column from the token ids

    @classmethod
    def of(cls, spec: Any, plain_samples: bool, llm: Any) -> TextPlan:
        """``spec``: the JobSpec; ``plain_samples``: the parts hold a generation's samples (not a task's rows, not
        OpenAI batch responses); ``llm``: the engine. Its ``spare_core`` says whether the writer's thread has a core
        of its own, and the writer decodes with its ``tokenizer`` (an engine of a job's own may have neither)."""
        spare_core = bool(getattr(llm, "spare_core", False)) and getattr(llm, "tokenizer", None) is not None
        s = spec.sampling
        overridden = any(key.split(".", 1)[0] in _TEXT_FIELDS for key in s.overrides)
        if (not plain_samples or s.beam_width or s.stop or s.structured_outputs or not s.detokenize or overridden
                or not s.spaces_between_special_tokens  # the engine's decode is the one that reads it
                or "parsed" in spec.output.fields):  # parsed: the text as JSON, where it is JSON
            return cls()
        if "text" not in spec.output.fields:
            return cls(engine_decodes=False)
        return cls(engine_decodes=False, writer_decodes=True) if spare_core else cls()


def decode_texts(tokenizer: Any, skip_special_tokens: bool, rows: list[dict[str, Any]]) -> None:
    """Sets the text of every sample row whose text is still to come (None) from its token ids, with the call the
    engine makes (`StopChecker.final_text` without a stop string), so the text is the same."""
    for r in rows:
        if r.get("text") is None and r.get("error") is None and "token_ids" in r:
            r["text"] = decode(tokenizer, r["token_ids"], skip_special_tokens) if r["token_ids"] else ""
