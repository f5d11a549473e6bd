"""LoRA adapters (batchgen/lora): PEFT parity on tiny Llama and Qwen2, mixed batches of many adapters,
adapter slots in the scheduler, the prefix cache keyed by adapter, and the one-line refusals."""

from __future__ import annotations

import json
import re

import pytest
import torch
import transformers as tf

from batchgen import _C, LLM, LoRARequest, SamplingParams, StructuredOutputsParams, ops

peft = pytest.importorskip("peft")
from lora_kit import hf_greedy, make_adapter, prompts_of  # noqa: E402  (after the skip: it imports peft)

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


CASES = [("llama", 8, ATTENTION, False, {}), ("llama", 64, "all-linear", True, {}),
         ("qwen2", 8, "all-linear", False, {}), ("qwen2", 64, ATTENTION, True, {}),
         ("llama", 8, ["q_proj", "v_proj", "up_proj"], False, {"rank_pattern": {"v_proj": 32}})]


@pytest.mark.parametrize(("arch", "rank", "targets", "rslora", "extra"), CASES,
                         ids=["llama-r8-attn", "llama-r64-all-rslora", "qwen2-r8-all", "qwen2-r64-attn-rslora",
                              "llama-r8-q-v-up-rank-pattern"])
def test_greedy_matches_peft_and_merged(tiny_model_dirs, tmp_path, arch, rank, targets, rslora, extra):
    base_dir = tiny_model_dirs[arch]
    adapter = make_adapter(base_dir, tmp_path / "adapter", rank, targets, seed=rank, rslora=rslora, **extra)
    base = tf.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    prompts = prompts_of(base.config.vocab_size)
    base_refs = hf_greedy(base, prompts)
    peft_model = peft.PeftModel.from_pretrained(base, adapter).eval()
    refs = hf_greedy(peft_model, prompts)
    assert refs != base_refs  # the adapter changes the output: the check below can fail
    assert hf_greedy(peft_model.merge_and_unload(), prompts) == refs
    llm = LLM(base_dir, dtype="float32", kv_cache_memory="16MiB", enable_lora=True, max_lora_rank=64)
    lora = LoRARequest("a", 1, str(adapter))
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=lora)
    assert tokens(outputs) == refs
    assert all(o.lora_request == lora for o in outputs)
    assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == base_refs


@pytest.fixture(scope="module")
def llama_adapters(tiny_model_dirs, tmp_path_factory):
    """Five adapters on the tiny Llama: ranks 4 to 64, attention-only and all-linear, one rsLoRA."""
    root = tmp_path_factory.mktemp("adapters")
    specs = [(8, ATTENTION, False), (16, "all-linear", False), (64, "all-linear", True),
             (4, ["q_proj", "v_proj"], False), (32, ["gate_proj", "up_proj", "down_proj"], False)]
    return [LoRARequest(f"a{i}", i + 1, str(make_adapter(tiny_model_dirs["llama"], root / f"a{i}", rank, targets,
                                                         seed=i, rslora=rslora)))
            for i, (rank, targets, rslora) in enumerate(specs)]


def _sampled(i: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=100 + i, max_tokens=12, ignore_eos=True, logprobs=2)


@pytest.mark.parametrize(("dtype", "kv_cache_dtype"), [("float32", "auto"), ("bfloat16", "auto"), ("bfloat16", "fp8")])
def test_mixed_batch_rows_match_each_row_alone(tiny_model_dirs, llama_adapters, dtype, kv_cache_dtype):
    """Five adapters and the base model over 40 prompts, two device slots, a KV cache small enough to preempt:
    every row's tokens and logprobs are bit-identical to the row run alone with its adapter. An fp8 cache too
    (with the bf16 GEMM, the adapters and the cache's scales both in the decoder stack)."""
    base_dir = tiny_model_dirs["llama"]
    prompts = prompts_of(400, lens=[5, 20, 33, 47, 64] * 8, seed=3)
    loras = [None if i % 6 == 5 else llama_adapters[i % 6] for i in range(len(prompts))]
    params = [_sampled(i) for i in range(len(prompts))]
    element = 1 if kv_cache_dtype == "fp8" else 4 if dtype == "float32" else 2
    block_bytes = 2 * 2 * 2 * 16 * 64 * element
    mixed = LLM(base_dir, dtype=dtype, kv_cache_memory=12 * block_bytes, swap_space="4MiB", enable_lora=True,
                max_loras=2, max_lora_rank=64, max_num_batched_tokens=128, max_num_seqs=16,
                kv_cache_dtype=kv_cache_dtype)
    outputs = mixed.generate(prompts, params, use_tqdm=False, lora_request=loras)
    stats = mixed.stats()
    assert stats["num_preemptions"] > 0 and stats["lora_loads"] > len(llama_adapters)
    alone = LLM(base_dir, dtype=dtype, kv_cache_memory="8MiB", enable_lora=True, max_loras=1, max_lora_rank=64,
                enable_prefix_caching=False, kv_cache_dtype=kv_cache_dtype)
    for prompt, p, lora, out in zip(prompts, params, loras, outputs, strict=True):
        ref = alone.generate([prompt], p, use_tqdm=False, lora_request=lora)[0].outputs[0]
        got = out.outputs[0]
        assert (got.token_ids, got.logprobs, got.cumulative_logprob) == (ref.token_ids, ref.logprobs,
                                                                         ref.cumulative_logprob)
    # Adapters matter: the same prompt and seed give other tokens under another adapter.
    same = [alone.generate([prompts[0]], params[0], use_tqdm=False, lora_request=lora)[0].outputs[0].token_ids
            for lora in [None, *llama_adapters]]
    assert len({tuple(t) for t in same}) == len(same)


def test_prefix_cache_keys_blocks_by_adapter(tiny_model_dirs, llama_adapters):
    prompt = prompts_of(400, lens=[70], seed=5)[0]
    llm = LLM(tiny_model_dirs["llama"], dtype="float32", kv_cache_memory="8MiB", enable_lora=True, max_loras=2,
              max_lora_rank=64)
    fresh = LLM(tiny_model_dirs["llama"], dtype="float32", kv_cache_memory="8MiB", enable_lora=True, max_loras=2,
                max_lora_rank=64, enable_prefix_caching=False)
    order = [llama_adapters[0], None, llama_adapters[1], llama_adapters[0]]
    hits = []
    for lora in order:
        before = llm.stats()["prefix_cache_hits"]
        got = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=lora)[0].outputs[0].token_ids
        assert got == fresh.generate([prompt], GREEDY, use_tqdm=False, lora_request=lora)[0].outputs[0].token_ids
        hits.append(llm.stats()["prefix_cache_hits"] - before)
    assert hits == [0, 0, 0, 64]  # only the same adapter again finds the prompt's 4 full blocks


def test_block_manager_never_shares_blocks_across_adapters():
    from batchgen.engine.block_manager import BlockManager
    from batchgen.engine.sequence import Sequence

    bm = BlockManager(16, 0, 4)
    first = Sequence(0, list(range(13)), lora_id=1)
    bm.allocate(first)
    bm.mark_computed(first, 0, 13)
    for seq_id, lora_id, expected in [(1, 2, 0), (2, 0, 0), (3, 1, 12)]:
        seq = Sequence(seq_id, list(range(13)), lora_id=lora_id)
        bm.allocate(seq)
        assert seq.num_computed_tokens == expected, lora_id


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel", [False, True], ids=["gemms", "segmented-kernel"])
def test_lora_rows_do_not_depend_on_their_segment(dtype, kernel):
    """A row's low-rank term is the same alone, in a segment of 37 rows, or beside other adapters' rows; with
    per-segment GEMMs, or with a float32 StackedLoRA and the segmented kernel (what LoRALinear does on CUDA)."""
    from batchgen.layers.linear import Linear
    from batchgen.layers.lora import LoRABatch, LoRALinear, LoRATarget, LoRAWeights, Segment, StackedLoRA
    from batchgen.lora.checkpoint import Adapter

    gen = torch.Generator().manual_seed(0)
    target = LoRATarget(0, 96, {"q_proj": (0, 64), "v_proj": (64, 32), "qkv_proj": (0, 96)})
    base = Linear(96, 96, bias=False).to(dtype).requires_grad_(False)  # batchgen's: rows independent of M
    batch = LoRABatch()
    layer = LoRALinear(base, target, batch, num_slots=2,
                       stacked=StackedLoRA(target, num_slots=2, max_rank=64) if kernel else None)
    adapters = []
    for slot, rank in enumerate((8, 64)):
        def pair(out: int, rank: int = rank) -> LoRAWeights:
            return LoRAWeights((torch.randn(rank, 96, generator=gen) * 0.1).to(dtype),
                               (torch.randn(out, rank, generator=gen) * 0.1).to(dtype))
        adapters.append(Adapter(LoRARequest(f"a{slot}", slot + 1, "."),
                                {(0, "q_proj"): pair(64), (0, "v_proj"): pair(32)}))
        layer.load(slot, adapters[-1], torch.device("cpu"))
    x = torch.randn(40, 96, generator=gen).to(dtype)
    batch.segments = [Segment(0, 37, 0), Segment(37, 40, 1)]
    together = layer(x)
    for row in (0, 5, 36, 37, 39):
        batch.segments = [Segment(0, 1, 0 if row < 37 else 1)]
        assert torch.equal(layer(x[row:row + 1])[0], together[row]), row
    # And it is the adapter's term: x A^T B^T on each part's rows of the output.
    for rows, adapter in ((slice(0, 37), adapters[0]), (slice(37, 40), adapters[1])):
        xf = x[rows].float()
        delta = torch.cat([xf @ adapter.modules[(0, name)].a.float().T @ adapter.modules[(0, name)].b.float().T
                           for name in ("q_proj", "v_proj")], dim=1)
        tol = 1e-4 if dtype == torch.float32 else 5e-2
        torch.testing.assert_close(together[rows].float(), base(x[rows]).float() + delta, rtol=tol, atol=tol)


@pytest.mark.parametrize("kernels", ["own", "avx2"], indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stacked_lora_slots_hold_each_pieces_pair(dtype, kernels):
    """StackedLoRA's slots, float32 or (in a bf16 model, where the GEMM has the bf16 dot product) bf16 pairs for
    it, hold each q/k/v piece's part of the adapter's pair, zero-padded; loading None empties a slot."""
    from batchgen.layers.lora import LoRATarget, LoRAWeights, StackedLoRA, adapter_pair
    from batchgen.lora.checkpoint import Adapter
    from batchgen.ops.reference import unpack_lora_bf16

    gen = torch.Generator().manual_seed(0)
    target = LoRATarget(0, 97, {"q_proj": (0, 64), "k_proj": (64, 16), "v_proj": (80, 16), "qkv_proj": (0, 96)})
    stacked = StackedLoRA(target, num_slots=2, max_rank=24, dtype=dtype)
    assert stacked.pairs == (dtype == torch.bfloat16 and not ops.gemm_widens_bf16())
    weights = {(0, "q_proj"): LoRAWeights(torch.randn(5, 97, generator=gen).to(dtype),
                                          torch.randn(64, 5, generator=gen).to(dtype)),
               (0, "qkv_proj"): LoRAWeights(torch.randn(7, 97, generator=gen).to(dtype),
                                            torch.randn(96, 7, generator=gen).to(dtype))}
    adapter = Adapter(LoRARequest("a", 1, "."), weights)
    stacked.load(1, adapter, torch.device("cpu"))
    checked = 0
    for (first, a, b_t, ranks), piece in zip(stacked.parts(), target.pieces(), strict=True):
        want_a, want_b = adapter_pair(adapter, target, piece)
        if stacked.pairs:
            assert a.dtype == b_t.dtype == torch.bfloat16 and a.shape[2] % _C.LORA_RANK_GROUP == 0
            a, b_t = unpack_lora_bf16(a, b_t, 97)
        else:
            assert a.dtype == b_t.dtype == torch.float32
        rank = int(ranks[1])
        assert first == piece[0] and rank == want_a.shape[0] and int(ranks[0]) == 0
        assert torch.equal(a[1, :rank], want_a.float()) and torch.equal(b_t[1, :rank], want_b.T.float())
        assert a[1, rank:].eq(0).all() and b_t[1, rank:].eq(0).all() and a[0].eq(0).all()
        checked += 1
    assert checked == 3
    stacked.load(1, None, torch.device("cpu"))
    assert all(a.eq(0).all() and b_t.eq(0).all() and ranks.eq(0).all() for _, a, b_t, ranks in stacked.parts())


def _check_adapter_slots(scheduler, out) -> None:
    """Running requests' adapters are resident, in distinct slots, at most max_loras of them; every scheduled
    row's slot is its adapter's."""
    slots = scheduler.adapters
    running = {g.lora_id for g in scheduler.running if g.lora_id}
    assert len(running) <= slots.num_slots
    resident = {lora_id: slots.slot_of(lora_id) for lora_id in running}
    assert None not in resident.values() and len(set(resident.values())) == len(resident)
    for s in out.scheduled:
        if s.seq.lora_id:
            assert out.lora_slots[s.seq.lora_id] == slots.slot_of(s.seq.lora_id)


def test_scheduler_keeps_busy_adapters_and_does_not_thrash():
    from fake_runner import FakeEngine

    from batchgen.engine import SchedulerConfig

    eng = FakeEngine(SchedulerConfig(block_size=4, num_device_blocks=200, max_num_seqs=16, max_num_batched_tokens=64,
                                     watermark=0.0, max_loras=2))
    groups = [eng.add(list(range(100 * i, 100 * i + 7)), max_tokens=5 + i % 3, lora_id=i % 4) for i in range(40)]
    while eng.scheduler.has_unfinished():
        out = eng.step()
        _check_adapter_slots(eng.scheduler, out)
    assert all(g.seqs[0].finish_reason == "length" for g in groups)
    # 3 adapters over 2 slots, 10 requests each, interleaved: each adapter is loaded a few times, not per request.
    assert 3 <= eng.scheduler.adapters.num_loads <= 6


def test_scheduler_serves_a_waiting_adapter_while_others_keep_arriving():
    """Adapters 1 and 2 hold both slots and keep getting new requests; the request for adapter 3 still runs
    soon: adapter 1's slot is reserved for it, so 1 gets no new requests until it drains."""
    from fake_runner import FakeEngine

    from batchgen.engine import SchedulerConfig

    eng = FakeEngine(SchedulerConfig(block_size=4, num_device_blocks=400, max_num_seqs=8, max_num_batched_tokens=64,
                                     watermark=0.0, max_loras=2))
    eng.add(list(range(7)), max_tokens=4, lora_id=1)
    eng.add(list(range(7)), max_tokens=4, lora_id=2)
    eng.step()
    waiting = eng.add(list(range(50, 57)), max_tokens=4, lora_id=3)
    for step in range(30):
        eng.add(list(range(7)), max_tokens=4, lora_id=1 + step % 2)
        out = eng.step()
        _check_adapter_slots(eng.scheduler, out)
        if waiting in eng.scheduler.running:
            break
    assert waiting in eng.scheduler.running and step <= 12, step


def _refusal(llm, lora: LoRARequest) -> str:
    with pytest.raises(ValueError) as info:
        llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False, lora_request=lora)
    message = str(info.value)
    assert "\n" not in message
    return message


def _edited(src, dst, config_changes: dict | None = None, tensors=None):
    """A copy of adapter `src` with its config changed and/or its tensors replaced by tensors(old)."""
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    config = json.loads((src / "adapter_config.json").read_text()) | (config_changes or {})
    (dst / "adapter_config.json").write_text(json.dumps(config))
    weights = load_file(str(src / "adapter_model.safetensors"))
    save_file(tensors(weights) if tensors else weights, str(dst / "adapter_model.safetensors"))
    return dst


@pytest.fixture(scope="module")
def lora_llm(tiny_model_dirs):
    return LLM(tiny_model_dirs["llama"], dtype="float32", kv_cache_memory="8MiB", enable_lora=True, max_lora_rank=16)


def test_refusals_are_one_line_naming_the_adapter(tiny_model_dirs, llama_adapters, lora_llm, tmp_path):
    from pathlib import Path

    base_dir, good = tiny_model_dirs["llama"], Path(llama_adapters[0].lora_path)

    def case(name: str, path) -> str:
        message = _refusal(lora_llm, LoRARequest(name, 50 + len(cases), str(path)))
        assert message.startswith(f"lora_request: adapter {name!r}"), message
        cases.append(name)
        return message

    cases: list[str] = []
    dora = make_adapter(base_dir, tmp_path / "dora", 8, ATTENTION, seed=1, use_dora=True)
    assert "DoRA" in case("dora", dora)
    embed = make_adapter(base_dir, tmp_path / "embed", 8, ["embed_tokens", "q_proj"], seed=1)
    assert "embeddings or the LM head" in case("embed", embed)
    head = make_adapter(base_dir, tmp_path / "head", 8, ["lm_head"], seed=1)
    assert "embeddings or the LM head" in case("head", head)
    assert "modules_to_save" in case("saved", _edited(good, tmp_path / "saved", {"modules_to_save": ["lm_head"]}))
    assert "is a IA3 adapter" in case("ia3", _edited(good, tmp_path / "ia3", {"peft_type": "IA3"}))

    def narrower(weights):
        return {k: (v[:, :64].contiguous() if "q_proj.lora_A" in k else v) for k, v in weights.items()}
    assert "do not fit the base model's [256, 128] projection" in case("shape", _edited(good, tmp_path / "shape",
                                                                                        tensors=narrower))

    def unknown(weights):
        a = next(v for k, v in weights.items() if "q_proj.lora_A" in k)
        return weights | {"base_model.model.model.layers.0.mlp.fc1.lora_A.weight": a.clone()}
    assert "targets 'fc1', which this model does not have" in case("unknown", _edited(good, tmp_path / "unknown",
                                                                                      tensors=unknown))
    assert "layer 7" in case("deep", _edited(good, tmp_path / "deep", tensors=lambda w: {
        k.replace("layers.0.", "layers.7."): v for k, v in w.items()}))
    rank64 = Path(llama_adapters[2].lora_path)
    assert "rank 64, more than max_lora_rank 16" in case("big", rank64)
    assert "no such directory" in case("missing", tmp_path / "nowhere")
    # The engine goes on serving: a good adapter and the base model still run.
    assert lora_llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False, lora_request=llama_adapters[0])[0].error is None
    same_id = LoRARequest("other", llama_adapters[0].lora_int_id, str(Path(llama_adapters[1].lora_path)))
    assert "names adapter 'a0'" in _refusal(lora_llm, same_id)


def test_adapter_from_a_bin_file_matches_safetensors(llama_adapters, lora_llm, tmp_path):
    from pathlib import Path

    from safetensors.torch import load_file

    src = Path(llama_adapters[0].lora_path)
    dst = tmp_path / "bin"
    dst.mkdir()
    (dst / "adapter_config.json").write_text((src / "adapter_config.json").read_text())
    torch.save(load_file(str(src / "adapter_model.safetensors")), dst / "adapter_model.bin")
    prompts = prompts_of(400, seed=9)
    expected = tokens(lora_llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=llama_adapters[0]))
    assert tokens(lora_llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=LoRARequest("bin", 77, dst))) \
        == expected


def test_lora_request_needs_enable_lora(tiny_model_dirs, llama_adapters):
    llm = LLM(tiny_model_dirs["llama"], dtype="float32", kv_cache_memory="8MiB")
    assert "pass enable_lora=True" in _refusal(llm, llama_adapters[0])
    with pytest.raises(ValueError, match="lora_request: 2 given for 1 prompts"):
        llm.generate([[5, 6]], GREEDY, use_tqdm=False, lora_request=[None, None])
    with pytest.raises(ValueError, match="lora_int_id: must be an integer >= 1"):
        LoRARequest("x", 0, "/tmp")


@pytest.mark.parametrize(("arch", "rank", "targets"), [("olmo2", 8, "all-linear"), ("gpt_neox", 16, None),
                                                     ("llama", 64, ATTENTION)])
def test_transformers_backend_matches_peft(tmp_path, tiny_model_dirs, arch, rank, targets):
    """Architectures on the transformers backend (Olmo2, GPT-NeoX with its own module names; Llama forced onto
    it): greedy float32 output under an adapter is PEFT's token for token, in a batch mixed with the base."""
    from model_zoo import build_zoo_model

    base_dir = tiny_model_dirs["llama"] if arch == "llama" else build_zoo_model(tmp_path / arch, arch)
    adapter = make_adapter(base_dir, tmp_path / "adapter", rank, targets, seed=rank)
    base = tf.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    prompts = prompts_of(base.config.vocab_size)
    base_refs = hf_greedy(base, prompts)
    refs = hf_greedy(peft.PeftModel.from_pretrained(base, adapter).eval(), prompts)
    assert refs != base_refs  # the adapter changes the output: the check below can fail
    llm = LLM(base_dir, dtype="float32", kv_cache_memory="16MiB", model_impl="transformers", enable_lora=True,
              max_lora_rank=64)
    lora = LoRARequest("a", 1, str(adapter))
    outputs = llm.generate(prompts * 2, GREEDY, use_tqdm=False, lora_request=[lora] * 4 + [None] * 4)
    assert tokens(outputs) == refs + base_refs


def test_every_batch_call_runs_the_adapter_like_its_merged_model(tiny_model_dirs, llama_adapters, tmp_path):
    """chat, n samples, beam_search, structured outputs, embed and score_completions under an adapter give what
    batchgen gives on the model with the adapter merged into its weights (PEFT's merge_and_unload)."""
    import shutil
    from pathlib import Path

    from batchgen import BeamSearchParams

    base_dir, lora = tiny_model_dirs["llama"], llama_adapters[1]
    base = tf.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    merged_dir = tmp_path / "merged"
    peft.PeftModel.from_pretrained(base, lora.lora_path).merge_and_unload().save_pretrained(merged_dir)
    for file in Path(base_dir).iterdir():
        if file.name.startswith(("tokenizer", "special_tokens", "generation_config", "chat_template")):
            shutil.copy(file, merged_dir / file.name)
    with_lora = LLM(base_dir, dtype="float32", kv_cache_memory="8MiB", enable_lora=True, max_lora_rank=16)
    merged = LLM(merged_dir, dtype="float32", kv_cache_memory="8MiB")
    chat = [{"role": "user", "content": "the quick brown fox"}]
    assert tokens(with_lora.chat(chat, GREEDY, use_tqdm=False, lora_request=lora)) == \
        tokens(merged.chat(chat, GREEDY, use_tqdm=False))
    prompts = prompts_of(400, lens=[6, 30], seed=4)
    samples = SamplingParams(n=3, temperature=0, max_tokens=8)  # children forked after the prefill run it too
    got = with_lora.generate(prompts, samples, use_tqdm=False, lora_request=lora)
    assert [[c.token_ids for c in o.outputs] for o in got] == \
        [[c.token_ids for c in o.outputs] for o in merged.generate(prompts, samples, use_tqdm=False)]
    beams = BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True)
    got = with_lora.beam_search(prompts, beams, use_tqdm=False, lora_request=[lora, lora])
    want = merged.beam_search(prompts, beams, use_tqdm=False)
    assert [[s.tokens for s in o.sequences] for o in got] == [[s.tokens for s in o.sequences] for o in want]
    regex = r"[a-z]{2,6}-\d{1,3}"
    constrained = SamplingParams(temperature=0, max_tokens=12, structured_outputs=StructuredOutputsParams(regex=regex))
    got = with_lora.generate(prompts, constrained, use_tqdm=False, lora_request=lora)
    assert tokens(got) == tokens(merged.generate(prompts, constrained, use_tqdm=False))
    assert all(re.fullmatch(regex, o.outputs[0].text) for o in got), [o.outputs[0].text for o in got]
    base = LLM(base_dir, dtype="float32", kv_cache_memory="8MiB")
    assert tokens(got) != tokens(base.generate(prompts, constrained, use_tqdm=False))  # the adapter was applied
    embedded = with_lora.embed(prompts, use_tqdm=False, lora_request=lora)
    for a, b in zip(embedded, merged.embed(prompts, use_tqdm=False), strict=True):
        torch.testing.assert_close(torch.tensor(a.outputs.embedding), torch.tensor(b.outputs.embedding),
                                   rtol=1e-4, atol=1e-5)
    scored = with_lora.score_completions(prompts, [[7, 8, 9], [10, 11]], use_tqdm=False, lora_request=lora)
    for a, b in zip(scored, merged.score_completions(prompts, [[7, 8, 9], [10, 11]], use_tqdm=False), strict=True):
        assert a.logprob == pytest.approx(b.logprob, rel=1e-4, abs=1e-4)
    base_scored = base.score_completions(
        prompts, [[7, 8, 9], [10, 11]], use_tqdm=False)
    assert all(abs(a.logprob - b.logprob) > 1e-3 for a, b in zip(scored, base_scored, strict=True))


def test_guide_example_runs(tiny_model_dirs, tmp_path):
    """docs/lora.md's example as written, on the tiny Llama with two adapters at the paths it names."""
    import os
    import re
    import subprocess
    import sys

    from jobkit import REPO

    guide = (REPO / "docs" / "lora.md").read_text(encoding="utf-8")
    (code,) = re.findall(r"<!-- readme-test: python lora -->\n```python\n(.*?)```", guide, re.S)
    home = tmp_path / "home"
    model = home / ".cache" / "batchgen" / "models" / "SmolLM2-135M-Instruct"
    model.parent.mkdir(parents=True)
    model.symlink_to(tiny_model_dirs["llama"], target_is_directory=True)
    for name, rank in (("sql-lora", 8), ("chat-lora", 16)):
        make_adapter(tiny_model_dirs["llama"], home / "adapters" / name, rank, "all-linear", seed=rank)
    env = {**os.environ, "HOME": str(home), "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert [line.split()[0] for line in lines[:3]] == ["sql", "chat", "base"]
    assert lines[1].split(" ", 1)[1] != lines[2].split(" ", 1)[1]  # the same prompt, another adapter


@pytest.mark.slow
def test_smollm2_greedy_matches_peft(smollm2_dir, tmp_path):
    adapter = make_adapter(smollm2_dir, tmp_path / "adapter", 16, "all-linear", seed=0)
    base = tf.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    tokenizer = tf.AutoTokenizer.from_pretrained(smollm2_dir)
    prompts = [tokenizer.encode(text) for text in ("The capital of France is", "def fibonacci(n):")]
    refs = hf_greedy(peft.PeftModel.from_pretrained(base, adapter).eval(), prompts)
    llm = LLM(smollm2_dir, dtype="float32", kv_cache_memory="64MiB", enable_lora=True)
    lora = LoRARequest("a", 1, str(adapter))
    assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=lora)) == refs
    assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) != refs  # the adapter changes the output


@pytest.mark.skipif(not ops.has_gemm_bf16(), reason="the decoder stack runs on batchgen's bf16 GEMM (x86-64)")
@pytest.mark.parametrize("kernels", ["own", "avx512", "avx2"], indirect=True)
def test_bf16_stack_scores_like_the_float32_reference(tiny_model_dirs, llama_adapters, kernels):
    """In bf16 the C++ decoder stack adds the adapters' terms inside its GEMMs. The reference is float32 on the
    Python layers' `LoRALinear` (token-identical to PEFT above); the bf16 Python path (forced by packing under
    kernels without the bf16 GEMM) sets the bf16 noise level. The stack's scores must be within twice that
    noise, far closer than the adapters move them; and enabling LoRA leaves base-model rows bit-identical to
    the engine without LoRA, even in steps shared with adapter rows."""
    base_dir = tiny_model_dirs["llama"]
    options = dict(kv_cache_memory="8MiB", enable_lora=True, max_loras=3, max_lora_rank=64)
    stacked = LLM(base_dir, dtype="bfloat16", **options)
    assert stacked.engine.runner.model.decoder_stack is not None
    _C.set_cpu_isa("scalar")
    try:
        python_layers = LLM(base_dir, dtype="bfloat16", **options)
    finally:
        _C.set_cpu_isa(kernels)
    assert python_layers.engine.runner.model.decoder_stack is None
    reference = LLM(base_dir, dtype="float32", **options)
    prompts = prompts_of(400, lens=[6, 30, 45, 20, 12, 60], seed=4)
    completions = [list(range(7 + i, 15 + i)) for i in range(len(prompts))]
    loras = [llama_adapters[i] for i in (1, 2, 4, 1, 2, 4)]

    def scores(llm, lora):
        return torch.tensor([o.logprob for o in llm.score_completions(prompts, completions, use_tqdm=False,
                                                                      lora_request=lora)])

    want = scores(reference, loras)
    ours, noise = (scores(stacked, loras) - want).abs().max(), (scores(python_layers, loras) - want).abs().max()
    effect = (want - scores(reference, None)).abs().min()
    assert ours <= 2 * noise and effect > 4 * ours, (ours, noise, effect)
    plain = LLM(base_dir, dtype="bfloat16", kv_cache_memory="8MiB")
    assert torch.equal(scores(stacked, None), scores(plain, None))
    got = stacked.generate(prompts[:3], GREEDY, use_tqdm=False, lora_request=[None, llama_adapters[0], None])
    want = plain.generate(prompts[:3], GREEDY, use_tqdm=False)
    assert [tokens([got[i]]) for i in (0, 2)] == [tokens([want[i]]) for i in (0, 2)]
