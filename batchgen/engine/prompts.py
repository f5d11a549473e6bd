"""Prompts into token ids: a text (the tokenizer's special tokens added), a chat conversation (rendered
with the model's chat template, whose text carries its own special tokens) or token ids (checked against
the vocabulary, never trusted)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

Prompt = str | list[int] | list[dict]


@dataclass(frozen=True)
class EncodedPrompt:
    """A text or chat prompt as `PromptEncoder.encode_batch` encoded it: its text and its token ids,
    which adding it neither encodes nor checks again."""

    text: str
    token_ids: list[int]


def is_chat(prompt: object) -> bool:
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict)


class PromptEncoder:
    def __init__(self, tokenizer: Any, vocab_size: int):
        self.tokenizer = tokenizer  # None: token ids only (skip_tokenizer_init)
        self.vocab_size = vocab_size
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:
            # What transformers' first encode would do anyway (it encodes without truncation or padding),
            # done now so that no later encode changes the Rust tokenizer while another thread is using it
            # (a "borrowed" error there); the job's row reader encodes on a thread of its own.
            if backend.truncation is not None:
                backend.no_truncation()
            if backend.padding is not None:
                backend.no_padding()

    def encode(self, prompt: Prompt | EncodedPrompt) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt."""
        if isinstance(prompt, EncodedPrompt):
            return prompt.text, prompt.token_ids
        if isinstance(prompt, str):
            return prompt, self.needs_tokenizer("a text prompt").encode(prompt)
        if is_chat(prompt):
            text = self.chat_text(prompt)
            return text, self.tokenizer.encode(text, add_special_tokens=False)
        return None, self.checked_token_ids("prompt", prompt)

    def encode_batch(self, prompts: Sequence[Any]) -> list[Any]:
        """Every text and chat prompt as an `EncodedPrompt`, the texts in one call of the tokenizer and the
        chats in another: a fast tokenizer then splits the work over its threads, in Rust, without the GIL,
        and the per-call cost is paid once. Token ids come back as they are (adding them checks them); a
        prompt that cannot be encoded comes back as the ValueError (or TypeError) that
        `encode` would raise."""
        out: list[Any] = list(prompts)
        texts: list[int] = []
        chats: list[tuple[int, str]] = []
        for i, prompt in enumerate(prompts):
            try:
                if isinstance(prompt, str):
                    self.needs_tokenizer("a text prompt")
                    texts.append(i)
                elif is_chat(prompt):
                    chats.append((i, self.chat_text(prompt)))
            except (ValueError, TypeError) as e:
                out[i] = e
        if texts:
            ids = self.tokenizer([prompts[i] for i in texts])["input_ids"]
            for i, token_ids in zip(texts, ids, strict=True):
                out[i] = EncodedPrompt(prompts[i], token_ids)
        if chats:
            ids = self.tokenizer([text for _, text in chats], add_special_tokens=False)["input_ids"]
            for (i, text), token_ids in zip(chats, ids, strict=True):
                out[i] = EncodedPrompt(text, token_ids)
        return out

    def chat_text(self, messages: list[dict]) -> str:
        return self.needs_tokenizer("a chat prompt").apply_chat_template(messages, tokenize=False,
                                                                          add_generation_prompt=True)

    def needs_tokenizer(self, what: str) -> Any:
        if self.tokenizer is None:
            raise ValueError(f"prompt: {what} needs a tokenizer, and this engine has none "
                             "(skip_tokenizer_init=True); give token ids")
        return self.tokenizer

    def checked_token_ids(self, field: str, ids: object, allow_empty: bool = False) -> list[int]:
        """Token ids the embedding can look up: a ValueError naming the field and the bad id
        here, instead of an IndexError in a step that holds other requests."""
        if not isinstance(ids, (list, tuple)) or (not ids and not allow_empty):
            raise ValueError(f"{field}: expected a non-empty list of token ids, got {type(ids).__name__}")
        for i, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, int):
                raise ValueError(f"{field}: [{i}] is {t!r}, not an integer token id")
            if not 0 <= t < self.vocab_size:
                raise ValueError(f"{field}: token id {t} at [{i}] is outside the model's vocabulary "
                                 f"(0..{self.vocab_size - 1})")
        return list(ids)
