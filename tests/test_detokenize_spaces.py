"""engine/detokenize.py: vLLM's spaces_between_special_tokens on a slow (Python) tokenizer, where it applies."""

from __future__ import annotations

from batchgen.engine.detokenize import decode


class SlowTokenizer:
    """The calls a slow tokenizer answers: words are tokens, "<x>" and "</s>" are added, "</s>" special."""

    is_fast = False
    all_special_tokens = ["</s>"]
    vocab = ["hello", "world", "<x>", "</s>"]

    def get_added_vocab(self) -> dict[str, int]:
        return {"<x>": 2, "</s>": 3}

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [self.vocab[i] for i in ids]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return "_".join(tokens)


def test_added_tokens_are_spaced_from_the_text_unless_asked_not_to():
    tok, ids = SlowTokenizer(), [0, 1, 2, 0, 3]
    assert decode(tok, ids, skip_special_tokens=False) == "hello_world <x> hello </s>"
    assert decode(tok, ids, skip_special_tokens=False, spaces_between_special_tokens=False) == \
        "hello_world<x>hello</s>"
    assert decode(tok, ids, skip_special_tokens=True, spaces_between_special_tokens=False) == "hello_world<x>hello"
