"""Beam search: the fork/prune bookkeeping on shared blocks, and the engine's hypotheses and
scores against transformers' `generate(num_beams=k)` in float32, however the engine runs them."""

from __future__ import annotations

import collections
import re
from pathlib import Path

import pytest
import torch
import transformers as tf
from conftest import ARCHITECTURES
from fake_runner import FakeEngine, assert_pools_whole, check_invariants

from batchgen import LLM, BeamSearchParams, SamplingParams
from batchgen.engine import SchedulerConfig
from batchgen.engine.beam_search import BeamSearch
from batchgen.engine.sequence import Sequence
from batchgen.engine.stopping import StopChecker

GUIDE = (Path(__file__).resolve().parents[1] / "docs" / "beam-search.md").read_text(encoding="utf-8")

# --- bookkeeping on the fake runner ----------------------------------------------------------


def _prefilled_beam_group(width: int = 3, prompt_len: int = 10, block_size: int = 4):
    eng = FakeEngine(SchedulerConfig(block_size=block_size, num_device_blocks=32, max_num_seqs=8,
                                     max_num_batched_tokens=64, enable_prefix_caching=False))
    group = eng.add(list(range(1, prompt_len + 1)), max_tokens=100, beam_width=width)
    _forward(eng)  # the prompt's prefill
    return eng, group


def _forward(eng: FakeEngine):
    """One scheduled step through the fake cache, the beams left for the test to move."""
    out = eng.scheduler.schedule()
    eng.kv.execute(out)
    eng.scheduler.on_step_done(out)
    return out


def _used(eng: FakeEngine) -> int:
    return eng.scheduler.block_manager.num_used_device_blocks


def test_survivors_fork_by_reference_and_only_the_written_last_block_is_copied():
    eng, group = _prefilled_beam_group()
    sched, bm = eng.scheduler, eng.scheduler.block_manager
    (parent,) = group.unfinished_seqs()
    table, used = list(parent.block_table), _used(eng)
    beams = sched.next_beams(group, [(parent, 50), (parent, 51), (parent, 52)])
    assert beams[0] is parent and [b.sample_index for b in beams] == [0, 1, 2]
    assert all(b.block_table == table for b in beams) and _used(eng) == used  # no block taken
    assert all(bm.ref_count(b) == 3 for b in table)
    assert [b.output_token_ids for b in beams] == [[50], [51], [52]]
    out = _forward(eng)  # each beam writes position 10, in the shared, partly filled third block
    assert sorted(src for src, _ in out.blocks_to_copy) == [table[2], table[2]]  # two copies; the last writer keeps it
    assert all(b.block_table[:2] == table[:2] for b in beams)
    assert all(bm.ref_count(b) == 3 for b in table[:2])
    check_invariants(sched, eng.kv)


def test_a_pruned_beam_returns_its_blocks_at_once():
    eng, group = _prefilled_beam_group(prompt_len=8)  # two full blocks, shared by every beam
    sched, bm = eng.scheduler, eng.scheduler.block_manager
    (parent,) = group.unfinished_seqs()
    a, b, c = sched.next_beams(group, [(parent, 50), (parent, 51), (parent, 52)])
    for _ in range(5):  # each beam writes a block of its own
        _forward(eng)
        sched.next_beams(group, [(s, 60) for s in (a, b, c)])
    own = {s.seq_id: [blk for blk in s.block_table if bm.ref_count(blk) == 1] for s in (a, b, c)}
    assert all(len(blocks) == 2 for blocks in own.values())
    free = bm.num_free_device_blocks
    beams = sched.next_beams(group, [(a, 70), (a, 71)])  # b and c are pruned; a gets a second child
    assert b.is_finished() and c.is_finished() and b.finish_reason == "pruned" and not b.block_table
    assert bm.num_free_device_blocks == free + len(own[b.seq_id]) + len(own[c.seq_id])
    assert all(blk in bm.free_block_ids() for blk in own[b.seq_id] + own[c.seq_id])
    assert group.seqs == beams and beams[0] is a
    check_invariants(sched, eng.kv)


def test_next_beams_refuses_what_a_step_cannot_do():
    eng, group = _prefilled_beam_group(width=2)
    sched = eng.scheduler
    (parent,) = group.unfinished_seqs()
    with pytest.raises(ValueError, match="3 beams for beam width 2"):
        sched.next_beams(group, [(parent, 1)] * 3)
    other = eng.add([5, 6, 7], beam_width=2)
    with pytest.raises(ValueError, match="not running in request"):
        sched.next_beams(group, [(other.seqs[0], 1)])
    sched.schedule()
    with pytest.raises(RuntimeError, match="before on_step_done"):
        sched.next_beams(group, [(parent, 1)])


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_beam_groups_preempt_as_a_unit_and_come_back_whole(mode):
    """Two beam searches on a pool that holds one: the newer is preempted with all its beams, its
    beams come back (recompute: each prefilled again, in chunks over several steps, and moved on
    once all are computed), and every pool is whole after."""
    eng = FakeEngine(SchedulerConfig(block_size=4, num_device_blocks=18, num_cpu_blocks=64, max_num_seqs=8,
                                     max_num_batched_tokens=8, preemption_mode=mode, enable_prefix_caching=False))
    for k in range(2):
        eng.add([k + 1] * 7, max_tokens=40, beam_width=3)
    eng.run()
    stats = eng.scheduler.stats()
    assert stats.num_swap_preemptions + stats.num_recompute_preemptions > 0
    assert all(g.error is None and len(g.seqs) >= 1 for g in eng.finished.values())
    eng.check_outputs()
    assert_pools_whole(eng.scheduler)


# --- the engine against transformers -----------------------------------------------------------

PROMPTS = [
    "the quick brown fox jumps over the lazy dog and",
    "the quick brown fox jumps over the lazy dog, then",
    "paged attention keeps",
    "hello world, this is batchgen",
]
SETTINGS = [(0.5, False), (1.0, True), (2.0, False), (1.0, False), (0.5, True), (2.0, True)]
WIDTH, MAX_NEW = 3, 10
# Engine set-ups: block sizes 8 and 32, prefix caching on and off, chunked prefill, and a pool so
# small that the beams are preempted (swap, then recompute).
RUNS = {
    "plain": dict(block_size=8),
    "block32-no-prefix-cache": dict(block_size=32, enable_prefix_caching=False),
    "chunked-swap": dict(block_size=8, max_num_batched_tokens=16, max_num_seqs=12, kv_cache_memory=10 * 16384,
                         swap_space="4MiB"),
    "recompute": dict(block_size=8, max_num_batched_tokens=16, max_num_seqs=12, kv_cache_memory=10 * 16384,
                      preemption_mode="recompute", enable_prefix_caching=False),
}


def _common_tokens(hf, tokenizer, count: int) -> list[int]:
    """The tokens the model's greedy outputs use most: as stop tokens, they end beams often."""
    counts = collections.Counter()
    for prompt in PROMPTS:
        ids = torch.tensor([tokenizer.encode(prompt)])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                          eos_token_id=None, pad_token_id=tokenizer.pad_token_id)
        counts.update(out[0, ids.shape[1]:].tolist())
    return [t for t, _ in counts.most_common(count)]


def hf_beams(hf, tokenizer, prompt_ids: list[int], width: int, max_new: int, length_penalty: float,
             early_stopping: bool, stop_ids: list[int], min_new: int = 0,
             **inputs) -> list[tuple[list[int], float]]:
    """transformers' returned hypotheses: (output tokens, score), best first; `inputs`: more arguments of
    `generate` (a vision-language model's images); on the model's device."""
    ids = torch.tensor([prompt_ids], device=hf.device)
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), num_beams=width, num_return_sequences=width,
                      do_sample=False, max_new_tokens=max_new, min_new_tokens=min_new, length_penalty=length_penalty,
                      early_stopping=early_stopping, eos_token_id=stop_ids, pad_token_id=tokenizer.pad_token_id,
                      return_dict_in_generate=True, output_scores=True, **inputs)
    lengths = (out.beam_indices != -1).sum(dim=1).tolist()
    n = len(prompt_ids)
    return [(out.sequences[i, n:n + lengths[i]].tolist(), out.sequences_scores[i].item()) for i in range(width)]


def assert_same_beams(got, want, context) -> None:
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in want], context
    for (_, a), (_, b) in zip(got, want, strict=True):
        assert a == pytest.approx(b, abs=1e-4), context


# Every engine set-up on Llama; one pressured set-up besides the plain one for the other architectures.
CASES = [("llama", run) for run in RUNS] + [
    ("mistral", "chunked-swap"), ("qwen2", "recompute"), ("qwen3", "block32-no-prefix-cache"),
    ("llama3_rope", "chunked-swap"), *((arch, "plain") for arch in ARCHITECTURES if arch != "llama")]
assert {arch for arch, _ in CASES} == set(ARCHITECTURES)


class _Cases(dict):
    """arch -> (model dir, stop tokens, transformers' beams per setting), built on first use."""

    def __init__(self, dirs):
        super().__init__()
        self.dirs = dirs

    def __missing__(self, arch):
        path = self.dirs[arch]
        tokenizer = tf.AutoTokenizer.from_pretrained(path)
        hf = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        stop_ids = _common_tokens(hf, tokenizer, 2)  # frequent tokens, so beams end before max_tokens
        eos = [tokenizer.eos_token_id]
        refs = {(lp, es): [hf_beams(hf, tokenizer, tokenizer.encode(p), WIDTH, MAX_NEW, lp, es, eos + stop_ids)
                           for p in PROMPTS] for lp, es in SETTINGS}
        self[arch] = (path, stop_ids, refs)
        return self[arch]


@pytest.fixture(scope="module")
def arch_cases(tiny_model_dirs):
    return _Cases(tiny_model_dirs)


def run_beams(llm: LLM, stop_ids: list[int]) -> dict[tuple[float, bool], list[list[tuple[list[int], float]]]]:
    """Every setting's beam searches of every prompt, all in the engine at once."""
    params = [BeamSearchParams(beam_width=WIDTH, max_tokens=MAX_NEW, length_penalty=lp, early_stopping=es,
                               stop_token_ids=stop_ids) for lp, es in SETTINGS for _ in PROMPTS]
    outs = llm.generate(PROMPTS * len(SETTINGS), params, use_tqdm=False)
    assert all(o.error is None for o in outs)
    beams = [[(c.token_ids, c.score) for c in o.outputs] for o in outs]
    return {setting: beams[i * len(PROMPTS):(i + 1) * len(PROMPTS)] for i, setting in enumerate(SETTINGS)}


@pytest.mark.parametrize(("arch", "run"), CASES)
def test_hypotheses_and_scores_match_transformers(request, arch, run):
    """Every length penalty and early-stopping setting, however the engine runs the beams."""
    path, stop_ids, refs = request.getfixturevalue("arch_cases")[arch]
    llm = LLM(path, dtype="float32", **RUNS[run])
    ended_early = 0
    for setting, got in run_beams(llm, stop_ids).items():
        for i, (g, w) in enumerate(zip(got, refs[setting], strict=True)):
            assert_same_beams(g, w, (run, setting, PROMPTS[i]))
            ended_early += sum(len(tokens) < MAX_NEW for tokens, _ in g)
    assert ended_early > 0  # stop tokens finished some hypotheses before max_tokens
    stats = llm.stats()
    if run == "chunked-swap":
        assert stats["swap_preemptions"] > 0
    if run == "recompute":
        assert stats["recompute_preemptions"] > 0
    assert stats["kv_cache_usage"] == 0  # every block back once the searches are done


def test_min_tokens_eos_and_results_for_each_prompt_kind(tiny_model_dirs):
    """min_tokens holds EOS and stop tokens back as transformers' min_new_tokens does; text, token
    ids and chat prompts give the same beams as their token ids."""
    path = tiny_model_dirs["qwen2"]
    tokenizer = tf.AutoTokenizer.from_pretrained(path)
    hf = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    stop_ids = _common_tokens(hf, tokenizer, 1)
    llm = LLM(path, dtype="float32", block_size=16)
    params = BeamSearchParams(beam_width=4, max_tokens=8, min_tokens=3, stop_token_ids=stop_ids)
    chat = [{"role": "user", "content": "hello world"}]
    chat_ids = tokenizer.encode(tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True),
                                add_special_tokens=False)
    prompt_ids = tokenizer.encode(PROMPTS[0])
    outs = llm.beam_search([PROMPTS[0], prompt_ids, {"prompt_token_ids": prompt_ids}, {"prompt": PROMPTS[0]}, chat],
                           params, use_tqdm=False)
    first = [(s.output_token_ids, s.score) for s in outs[0].sequences]
    for out in outs[1:4]:
        assert [(s.output_token_ids, s.score) for s in out.sequences] == first
    eos = [tokenizer.eos_token_id] + stop_ids
    for out, ids in ((outs[0], prompt_ids), (outs[4], chat_ids)):
        assert out.prompt_token_ids == ids
        assert_same_beams([(s.output_token_ids, s.score) for s in out.sequences],
                          hf_beams(hf, tokenizer, ids, 4, 8, 1.0, False, eos, min_new=3), "min_tokens")
        assert all(len(s.output_token_ids) >= 3 for s in out.sequences)
    best = outs[0].sequences[0]
    assert best.tokens == prompt_ids + best.output_token_ids
    assert best.text == tokenizer.decode(best.output_token_ids, skip_special_tokens=True)
    assert best.score == pytest.approx(best.cum_logprob / len(best.output_token_ids))


def test_beam_search_alongside_sampling_and_an_abort(tiny_model_dirs):
    """A beam search batched with sampled requests changes neither; an aborted beam search
    returns every block."""
    path = tiny_model_dirs["llama"]
    llm = LLM(path, dtype="float32", block_size=8)
    beams = BeamSearchParams(beam_width=4, max_tokens=12)
    alone = llm.beam_search(PROMPTS[:2], beams, use_tqdm=False)
    sampled = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=12)
    sampled_alone = llm.generate(PROMPTS[2:], sampled, use_tqdm=False)
    for i, p in enumerate(PROMPTS[:2]):
        llm.add_request(f"b{i}", p, beams)
    for i, p in enumerate(PROMPTS[2:]):
        llm.add_request(f"s{i}", p, sampled)
    llm.add_request("gone", PROMPTS[3], beams)
    done = {}
    for step in range(200):
        if step == 3:
            llm.abort_request("gone")
        for out in llm.step():
            done[out.request_id] = out
        if not llm.has_unfinished_requests():
            break
    assert "gone" not in done
    for i in range(2):
        assert [c.token_ids for c in done[f"b{i}"].outputs] == [s.output_token_ids for s in alone[i].sequences]
        assert [c.index for c in done[f"b{i}"].outputs] == list(range(4))
        assert [c.token_ids for c in done[f"s{i}"].outputs] == [c.token_ids for c in sampled_alone[i].outputs]
    assert llm.stats()["kv_cache_usage"] == 0


def test_stop_strings_end_beams_and_are_cut_from_the_text(tiny_model_dirs):
    path = tiny_model_dirs["llama"]
    llm = LLM(path, dtype="float32")
    free = llm.beam_search([PROMPTS[2]], BeamSearchParams(beam_width=2, max_tokens=12), use_tqdm=False)[0]
    text = free.sequences[0].text
    stop = text[len(text) // 2:][:2]
    assert stop.strip(), text
    # length_penalty 0 ranks by cumulative logprob, which an output cut short always wins
    out = llm.beam_search([PROMPTS[2]], BeamSearchParams(beam_width=2, max_tokens=12, stop=[stop], length_penalty=0.0),
                          use_tqdm=False)[0]
    stopped = [s for s in out.sequences if s.finish_reason == "stop"]
    assert stopped and all(s.stop_reason == stop and stop not in s.text for s in stopped)


def test_bad_beam_search_params_are_one_line_errors():
    with pytest.raises(ValueError, match=r"BeamSearchParams.beam_width: must be an integer >= 1 \(got 0\)"):
        BeamSearchParams(beam_width=0)
    with pytest.raises(ValueError, match="BeamSearchParams.temperature: .* only 0"):
        BeamSearchParams(beam_width=2, temperature=0.7)
    with pytest.raises(ValueError, match=r"BeamSearchParams.min_tokens: must be <= max_tokens"):
        BeamSearchParams(beam_width=2, max_tokens=2, min_tokens=3)


def test_equal_scores_rank_by_the_beam_then_the_token():
    """Continuations whose cumulative logprobs are equal rank by the parent's rank, then by token id, so the
    survivors never depend on how a sort breaks ties. Each beam's row puts its best logprob at a different
    token; beam 0's and beam 2's best tie with beam 1's second best."""
    vocab, width = 12, 3
    search = BeamSearch(BeamSearchParams(beam_width=width, max_tokens=10, ignore_eos=True),
                        StopChecker(None, {0}, max_model_len=100))
    beams = [Sequence(seq_id=i, token_ids=[1, 2, 3], num_prompt_tokens=2, sample_index=i) for i in range(width)]
    for beam, cumulative in zip(beams, (-1.0, -0.5, -1.0), strict=True):
        beam.cumulative_logprob = cumulative
    logprobs = torch.full((width, vocab), -30.0)
    logprobs[0, 9] = logprobs[2, 4] = -1.0  # totals -2.0
    logprobs[1, 7], logprobs[1, 5] = -0.5, -1.5  # totals -1.0 and -2.0
    logprobs[1, 8] = -1.5  # another -2.0 in beam 1, at a higher token id than 5
    survivors = search.step(beams, logprobs)
    assert [(beams.index(c.parent), c.token_id) for c in survivors] == [(1, 7), (0, 9), (1, 5)]
    assert [c.cumulative_logprob for c in survivors] == [-1.0, -2.0, -2.0]


@pytest.mark.slow
def test_smollm2_beams_match_transformers(smollm2_dir):
    """Every length penalty and early-stopping setting docs/beam-search.md names, each on two chats, all in
    the engine at once; the answers end (EOS) before max_tokens, so the settings matter."""
    tokenizer = tf.AutoTokenizer.from_pretrained(smollm2_dir)
    hf = tf.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    chats = [[{"role": "user", "content": q}] for q in ("What is the capital of France?", "Name three planets.")]
    ids = [tokenizer.encode(tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True),
                            add_special_tokens=False) for c in chats]
    llm = LLM(smollm2_dir, dtype="float32", block_size=16)
    eos = sorted(llm.engine.stopper.eos_token_ids)
    assert {lp for lp, _ in SETTINGS} == {0.5, 1.0, 2.0} and {es for _, es in SETTINGS} == {False, True}
    params = [BeamSearchParams(beam_width=4, max_tokens=16, length_penalty=lp, early_stopping=es)
              for lp, es in SETTINGS for _ in ids]
    outs = llm.generate(ids * len(SETTINGS), params, use_tqdm=False)
    ended_early = 0
    for i, (lp, es) in enumerate(SETTINGS):
        for prompt_ids, out in zip(ids, outs[i * len(ids):(i + 1) * len(ids)], strict=True):
            got = [(c.token_ids, c.score) for c in out.outputs]
            assert_same_beams(got, hf_beams(hf, tokenizer, prompt_ids, 4, 16, lp, es, eos), (lp, es, prompt_ids))
            ended_early += sum(len(tokens) < 16 for tokens, _ in got)
    assert ended_early > 0


def test_beams_share_their_blocks_a_fraction_of_the_unshared_memory(tiny_model_dirs):
    """Width 8 over 32 prompts of ~400 tokens and 64 new tokens: the engine's peak KV blocks against
    the same beams each holding its own copy of its table (the sum of the live beams' table lengths),
    both read after every step of the same run."""
    llm = LLM(tiny_model_dirs["llama"], dtype="float32", block_size=16, kv_cache_memory="160MiB", max_num_seqs=256)
    gen = torch.Generator().manual_seed(0)
    vocab = llm.engine.vocab_size
    params = BeamSearchParams(beam_width=8, max_tokens=64, ignore_eos=True)
    for i in range(32):
        length = 380 + int(torch.randint(0, 41, (1,), generator=gen))
        llm.add_request(f"p{i}", torch.randint(3, vocab, (length,), generator=gen).tolist(), params)
    sched = llm.engine.scheduler
    unshared_peak = used_peak = 0
    outputs = []
    while llm.has_unfinished_requests():
        outputs += llm.step()
        live = [seq for group in sched.running + sched.swapped for seq in group.unfinished_seqs()]
        unshared_peak = max(unshared_peak, sum(len(seq.block_table) for seq in live))
        used_peak = max(used_peak, sched.block_manager.num_used_device_blocks)
    assert len(outputs) == 32 and all(len(o.outputs) == 8 and o.error is None for o in outputs)
    assert all(len(c.token_ids) == 64 for o in outputs for c in o.outputs)
    stats = llm.stats()
    assert stats["num_preemptions"] == 0 and stats["kv_cache_usage"] == 0
    ratio = stats["peak_device_blocks"] / unshared_peak
    print(f"beam width 8, 32 prompts: peak {stats['peak_device_blocks']} blocks shared, {unshared_peak} unshared "
          f"({ratio:.3f}x); after-step peak {used_peak}")
    claimed = float(re.search(r"peaked at\s+([\d.]+)x the blocks of the same beams unshared", GUIDE)[1])
    assert ratio == pytest.approx(claimed, abs=0.01), f"docs/beam-search.md says {claimed}x"
