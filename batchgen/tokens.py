"""The prompt and outputs of one token list, for the classes that hold a sample's tokens as one list."""

from __future__ import annotations


class PromptThenOutputs:
    """Mixed into a class whose `token_ids` are the prompt followed by the outputs and whose `num_prompt_tokens`
    is the prompt's length: the two parts as new lists, made when asked, and the outputs' count without one."""

    __slots__ = ()  # a class with slots that mixes it in keeps them

    token_ids: list[int]
    num_prompt_tokens: int

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens
