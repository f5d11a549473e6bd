"""Token ids to text, as vLLM detokenizes: `skip_special_tokens` drops special tokens; with them kept,
`spaces_between_special_tokens` says whether a slow (Python) tokenizer puts a space between an added token and
the text beside it. A fast tokenizer (what batchgen loads for every model it ships with) decodes in one call
and ignores that flag, as vLLM's fast detokenizer does."""

from __future__ import annotations

from typing import Any


def decode(tokenizer: Any, token_ids: list[int], skip_special_tokens: bool = True,
           spaces_between_special_tokens: bool = True) -> str:
    if getattr(tokenizer, "is_fast", True) or not tokenizer.get_added_vocab():
        return tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
    tokens = tokenizer.convert_ids_to_tokens(token_ids)
    pieces = _pieces(tokenizer, tokens, skip_special_tokens)
    return (" " if spaces_between_special_tokens else "").join(pieces)


def _pieces(tokenizer: Any, tokens: list[str], skip_special_tokens: bool) -> list[str]:
    """The runs of ordinary tokens as text, with each added token on its own between them."""
    special, added = set(tokenizer.all_special_tokens), tokenizer.get_added_vocab()
    pieces: list[str] = []
    run: list[str] = []
    for token in tokens:
        if skip_special_tokens and token in special:
            continue
        if token not in added:
            run.append(token)
            continue
        if run:
            pieces.append(tokenizer.convert_tokens_to_string(run))
            run = []
        pieces.append(token)
    if run:
        pieces.append(tokenizer.convert_tokens_to_string(run))
    return pieces
