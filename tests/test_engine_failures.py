"""One request never ends a run: token ids are checked when a request is added, and a forward
that fails is traced to the request it fails on (bisection), the others finishing with the text
they would have had."""

from __future__ import annotations

import pytest
import torch

from batchgen import LLM, SamplingParams

POISON = 7  # a token id the patched forward fails on, only where it is fed as part of a prompt
PARAMS = SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=5, ignore_eos=True)


def prompts(count: int, poisoned: tuple[int, ...] = ()) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for i in range(count):
        ids = torch.randint(10, 300, (5 + 3 * i,), generator=gen).tolist()
        out.append([*ids[:2], POISON, *ids[2:]] if i in poisoned else ids)
    return out


def small_llm(model_dir, **options) -> LLM:
    return LLM(model_dir, dtype="float32", kv_cache_memory="8MiB", max_num_seqs=8, **options)


def fail_on_poison(llm: LLM, monkeypatch, always: bool = False) -> list[int]:
    """Patch the model runner so a step fails when it feeds POISON from a prompt; returns the
    list the failing steps' sizes (requests in the step) are appended to."""
    real = llm.engine.runner.execute
    sizes: list[int] = []

    def execute(out):
        fed = [s.seq.token_ids[s.start:min(s.end, s.seq.num_prompt_tokens)] for s in out.scheduled]
        if out.scheduled and (always or any(POISON in ids for ids in fed)):
            sizes.append(len({s.group.request_id for s in out.scheduled}))
            raise RuntimeError("boom")
        return real(out)

    monkeypatch.setattr(llm.engine.runner, "execute", execute)
    return sizes


def test_token_ids_are_checked_when_added(tiny_model_dirs):
    llm = small_llm(tiny_model_dirs["llama"])
    vocab = llm.engine.vocab_size
    for prompt, message in [
        ([5, vocab], f"prompt: token id {vocab} at [1] is outside the model's vocabulary (0..{vocab - 1})"),
        ([-1], "prompt: token id -1 at [0] is outside"),
        ([5, 2.0], "prompt: [1] is 2.0, not an integer token id"),
        ([True], "prompt: [0] is True, not an integer token id"),
        ([], "prompt: expected a non-empty list of token ids"),
    ]:
        with pytest.raises(ValueError) as e:
            llm.add_request("r", prompt, PARAMS)
        assert str(e.value).startswith(message), e.value
    with pytest.raises(ValueError, match=r"^stop_token_ids: token id \d+ at \[0\] is outside"):
        llm.add_request("r", [5, 6], SamplingParams(stop_token_ids=[vocab + 3]))
    assert not llm.has_unfinished_requests()  # nothing half-added
    assert llm.generate([[5, 6, 7]], PARAMS, use_tqdm=False)[0].error is None


def test_a_failing_forward_is_traced_to_its_request(tiny_model_dirs, monkeypatch):
    clean = small_llm(tiny_model_dirs["llama"]).generate(prompts(12), PARAMS, use_tqdm=False)
    llm = small_llm(tiny_model_dirs["llama"])
    sizes = fail_on_poison(llm, monkeypatch)
    outs = llm.generate(prompts(12, poisoned=(3, 9)), PARAMS, use_tqdm=False)
    for i, (out, ref) in enumerate(zip(outs, clean, strict=True)):
        if i in (3, 9):
            assert out.error == "the engine failed on this request: RuntimeError: boom"
        else:  # restarted with their own seeds: the same tokens as in a run without failures
            assert out.error is None
            assert [c.token_ids for c in out.outputs] == [c.token_ids for c in ref.outputs], i
    assert sizes[0] > 2 and sizes.count(1) == 2  # found by halving a step of several requests
    stats = llm.engine.scheduler.stats()
    assert stats.used_device_blocks == 0 and not llm.engine._held and not llm.engine._suspects


def test_a_forward_that_always_fails_ends_the_run(tiny_model_dirs, monkeypatch):
    llm = small_llm(tiny_model_dirs["llama"])
    sizes = fail_on_poison(llm, monkeypatch, always=True)
    with pytest.raises(RuntimeError, match="boom"):
        llm.generate(prompts(12), PARAMS, use_tqdm=False)
    assert sizes.count(1) == 3  # two requests blamed, the third lone failure is the engine's
