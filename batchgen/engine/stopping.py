"""Decides when a sample is done: EOS, stop token ids, stop strings, max_tokens, max_model_len."""

from __future__ import annotations

from dataclasses import dataclass

from batchgen.engine.detokenize import decode
from batchgen.sampling_params import SamplingParams

# Tokens decoded behind the newest one when looking for a stop string: enough to cover the
# longest stop string even when tokens are single bytes of a multi-byte character.
_STOP_WINDOW_EXTRA = 4


@dataclass
class StopDecision:
    reason: str  # "stop" | "length"
    stop_reason: int | str | None = None


@dataclass(frozen=True)
class StopWatch:
    """What can end a sample, for a test cheaper than StopChecker.check at every token: check decides only for a
    token in `tokens` or a sample `length` tokens long (prompt and outputs) or longer; every other token goes on.
    tokens None: check must see every token (stop strings)."""

    tokens: frozenset[int] | None
    length: int


class StopChecker:
    def __init__(self, tokenizer, eos_token_ids: set[int], max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def banned_tokens(self, params: SamplingParams, num_output_tokens: int) -> list[int]:
        """Tokens that would end the sample before min_tokens is reached."""
        return [] if num_output_tokens >= params.min_tokens else self._ending_tokens(params)

    def _ending_tokens(self, params: SamplingParams) -> list[int]:
        """The tokens that end a sample of `params` by themselves: EOS (unless ignored) and the stop tokens."""
        eos = [] if params.ignore_eos else sorted(self.eos_token_ids)
        return eos + list(params.stop_token_ids)

    def watch(self, params: SamplingParams, num_prompt_tokens: int) -> StopWatch:
        """The tokens and the length at which check may stop a sample of `params` after this prompt."""
        tokens = None if params.stop else frozenset(self._ending_tokens(params))
        length = self.max_model_len
        if params.max_tokens is not None:
            length = min(length, num_prompt_tokens + params.max_tokens)
        return StopWatch(tokens, length)

    def check(self, params: SamplingParams, token_ids: list[int], num_prompt_tokens: int) -> StopDecision | None:
        """Called after a token was appended to `token_ids` (prompt + outputs), which it reads in place: a copy of
        the outputs at every step would cost in proportion to their length."""
        num_outputs, last = len(token_ids) - num_prompt_tokens, token_ids[-1]
        if num_outputs >= params.min_tokens:
            if not params.ignore_eos and last in self.eos_token_ids:
                return StopDecision("stop", last)
            if last in params.stop_token_ids:
                return StopDecision("stop", last)
            if params.stop and (hit := self._stop_string_in_tail(params, token_ids, num_prompt_tokens)):
                return StopDecision("stop", hit)
        if params.max_tokens is not None and num_outputs >= params.max_tokens:
            return StopDecision("length")
        if len(token_ids) >= self.max_model_len:
            return StopDecision("length")
        return None

    def _stop_string_in_tail(self, params: SamplingParams, token_ids: list[int], num_prompt_tokens: int) -> str | None:
        longest = max(len(s) for s in params.stop)
        tail = token_ids[max(num_prompt_tokens, len(token_ids) - (longest + _STOP_WINDOW_EXTRA)):]  # outputs only
        text, before = self.text_of(params, tail), self.text_of(params, tail[:-1])
        return next((s for s in params.stop if s in text and s not in before), None)

    def text_of(self, params: SamplingParams, token_ids: list[int]) -> str:
        return decode(self.tokenizer, token_ids, params.skip_special_tokens, params.spaces_between_special_tokens)

    def final_text(self, params: SamplingParams, output: list[int], stop_reason: int | str | None) -> str:
        text = self.text_of(params, output)
        if isinstance(stop_reason, str):
            cut = text.find(stop_reason)
            if cut >= 0:
                text = text[: cut + len(stop_reason)] if params.include_stop_str_in_output else text[:cut]
        return text
