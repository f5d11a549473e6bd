"""The engine's xgrammar glue: each distinct constraint compiled once per tokenizer, one matcher
per sample, and the token bitmasks of a step's constrained rows.

A matcher lives as long as its sample: preemption (swap or recompute) keeps a sample's tokens,
so its matcher state stays exact without a replay. A fork copies the parent's matcher.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from batchgen.structured.params import StructuredOutputsParams, grammar_of, xgrammar_message

logger = logging.getLogger(__name__)


class GrammarBackend:
    """Compiles constraints for one tokenizer and fills token bitmasks, many matchers at once.

    Compiled grammars are kept for the `cache_size` constraints used last: a job whose rows share
    a few schemas compiles each once, and one with a schema per row does not grow without bound."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: set[int], cache_size: int = 256):
        import xgrammar as xgr

        self._xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=sorted(stop_token_ids))
        self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)  # the cache is ours, keyed by text
        self._compiled: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._cache_size = cache_size
        self._batch = xgr.BatchGrammarMatcher()
        self.vocab_size = vocab_size
        self.num_compiles = 0

    def compile(self, constraint: StructuredOutputsParams) -> Any:
        key = (constraint.kind, constraint.key)
        compiled = self._compiled.get(key)
        if compiled is None:
            # The first compile at INFO (`batchgen run` shows it: it can take seconds); a job with a
            # schema per row would otherwise print a line per row.
            logger.log(logging.DEBUG if self.num_compiles else logging.INFO,
                       "compiling a grammar for structured outputs (%s)", constraint.kind)
            try:
                compiled = self._compiler.compile_grammar(grammar_of(*key))
            except RuntimeError as e:  # the request's error (a row error in a job), never the engine's
                raise ValueError(f"structured_outputs.{constraint.kind}: {xgrammar_message(e)}") from None
            self.num_compiles += 1
            if len(self._compiled) >= self._cache_size:
                self._compiled.popitem(last=False)
        self._compiled[key] = compiled
        self._compiled.move_to_end(key)
        return compiled

    def start(self, constraint: StructuredOutputsParams) -> RequestGrammar:
        """The grammar state of a new request (its first sample starts at the prompt)."""
        return RequestGrammar(self._xgr, self.compile(constraint))

    def fill(self, matchers: list[Any]) -> torch.Tensor:
        """A packed bitmask [len(matchers), ceil(vocab / 32)] (int32; bit j of word i allows token
        32 i + j) whose row i holds the tokens matcher i allows next."""
        bitmask = self._xgr.allocate_token_bitmask(len(matchers), self.vocab_size)
        self._batch.batch_fill_next_token_bitmask(matchers, bitmask, list(range(len(matchers))))
        return bitmask


@dataclass
class RequestGrammar:
    """The matchers of one request's samples, by sequence id."""

    _xgr: Any
    compiled: Any
    matchers: dict[int, Any] = field(default_factory=dict)
    refused: set[int] = field(default_factory=set)  # samples that took a token the grammar refused

    def add(self, seq_id: int) -> None:
        self.matchers[seq_id] = self._xgr.GrammarMatcher(self.compiled)

    def fork(self, parent_id: int, child_id: int) -> None:
        self.matchers[child_id] = self.matchers[parent_id].fork()

    def reset(self) -> None:
        self.matchers.clear()
        self.refused.clear()

    def accept(self, seq_id: int, token_id: int) -> bool:
        """Advances the sample's matcher; True when the grammar has ended (its stop token was
        taken) or can no longer go on (a refused token)."""
        matcher = self.matchers[seq_id]
        if seq_id in self.refused:
            return True
        if not matcher.accept_token(token_id):
            self.refused.add(seq_id)
            return True
        return matcher.is_terminated()

    def complete(self, seq_id: int) -> bool:
        """Every token was accepted and they form a whole string of the grammar."""
        matcher = self.matchers[seq_id]
        return seq_id not in self.refused and (matcher.is_terminated() or matcher.is_completed())
