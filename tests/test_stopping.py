import pytest

from batchgen.config import EngineConfig, parse_bytes
from batchgen.engine.stopping import StopChecker
from batchgen.sampling_params import SamplingParams


class CharTokenizer:
    """Token t is chr(t); 0 is a special token (dropped when skipping special tokens)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(t) for t in ids if not (skip_special_tokens and t == 0))


EOS = 0
PROMPT = [ord(c) for c in "prompt"]


def run(params: SamplingParams, text: str, max_model_len: int = 1000):
    checker = StopChecker(CharTokenizer(), {EOS}, max_model_len)
    tokens = list(PROMPT)
    for t in [ord(c) if isinstance(c, str) else c for c in text]:
        tokens.append(t)
        decision = checker.check(params, tokens, len(PROMPT))
        if decision:
            output = tokens[len(PROMPT):]
            return decision, checker.final_text(params, output, decision.stop_reason), output
    return None, None, tokens[len(PROMPT):]


def test_eos_stops_unless_ignored():
    decision, _, output = run(SamplingParams(max_tokens=50), ["a", "b", EOS, "c"])
    assert (decision.reason, decision.stop_reason, len(output)) == ("stop", EOS, 3)
    decision, _, output = run(SamplingParams(max_tokens=50, ignore_eos=True), ["a", "b", EOS, "c"])
    assert decision is None and len(output) == 4


def test_stop_string_spanning_tokens_is_cut_from_the_text():
    decision, text, output = run(SamplingParams(max_tokens=50, stop=["END"]), "hello ENDING")
    assert (decision.stop_reason, text, "".join(map(chr, output))) == ("END", "hello ", "hello END")
    _, text, _ = run(SamplingParams(max_tokens=50, stop=["END"], include_stop_str_in_output=True), "hello ENDING")
    assert text == "hello END"


def test_min_tokens_bans_and_defers_stops():
    checker = StopChecker(CharTokenizer(), {EOS}, 1000)
    params = SamplingParams(max_tokens=50, min_tokens=3, stop_token_ids=[7])
    assert sorted(checker.banned_tokens(params, 2)) == [EOS, 7]
    assert checker.banned_tokens(params, 3) == []
    assert checker.banned_tokens(SamplingParams(min_tokens=3, ignore_eos=True), 0) == []
    decision, _, output = run(params, [7, 7, 7, 7])
    assert decision.stop_reason == 7 and len(output) == 3


def test_length_limits():
    decision, _, output = run(SamplingParams(max_tokens=3), "abcdef")
    assert decision.reason == "length" and len(output) == 3
    decision, _, output = run(SamplingParams(max_tokens=None), "abcdef", max_model_len=len(PROMPT) + 2)
    assert decision.reason == "length" and len(output) == 2


def test_parse_bytes_and_engine_config_errors():
    assert parse_bytes("4GiB", "x") == 4 * 2**30
    assert parse_bytes("512 MB", "x") == 512 * 10**6
    assert parse_bytes(1024, "x") == 1024
    with pytest.raises(ValueError, match="kv_cache_memory"):
        EngineConfig(model="m", kv_cache_memory="lots")
    with pytest.raises(ValueError, match="preemption_mode"):
        EngineConfig(model="m", preemption_mode="drop")
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig(model="m", block_size=12)


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=6), SamplingParams(max_tokens=50, ignore_eos=True),
    SamplingParams(max_tokens=None, stop_token_ids=[ord("x")], min_tokens=2), SamplingParams(stop=["ab"]),
], ids=["eos-and-length", "ignore-eos", "stop-token-min-tokens", "stop-string"])
def test_the_watch_lets_through_only_tokens_check_would_not_stop_at(params):
    """The engine calls check only where watch says a token may stop the sample: every token check stops at must
    be one watch flags, or the engine would run past a stop."""
    max_model_len = 20
    checker = StopChecker(CharTokenizer(), {EOS}, max_model_len)
    watch = checker.watch(params, len(PROMPT))
    stops = 0
    for text in ["abxab", "xxxxxxxx", "qqqq\0rs", "zzzzzzzzzzzzzzzzzzzz"]:
        tokens = list(PROMPT)
        for t in [ord(c) for c in text]:
            tokens.append(t)
            if checker.check(params, tokens, len(PROMPT)) is not None:
                stops += 1
                assert watch.tokens is None or t in watch.tokens or len(tokens) >= watch.length, (text, t)
                break
    assert stops >= 1  # the texts do reach a stop under each params
