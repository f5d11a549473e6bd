"""What needs a CUDA device beyond the kernel op tests (tests/test_ops.py and tests/test_attention_variants.py
run those on CUDA too): the segmented LoRA kernel against the reference, and the whole engine on CUDA against
transformers (and PEFT) on the same device. `bash scripts/gpu_check.sh` runs these; every test here skips
without a CUDA device and a `_C` built with its kernels."""

from __future__ import annotations

import gc

import pytest
import torch
import transformers as tf
from lora_kit import hf_greedy, make_adapter, prompts_of

from batchgen import _C, LLM, LoRARequest, SamplingParams, ops
from batchgen.ops import reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() and _C.has_cuda()),
                       reason="needs a CUDA device and batchgen._C built with CUDA"),
]


@pytest.fixture(autouse=True)
def _release_engines():
    """Each engine takes gpu_memory_utilization of the device for its KV cache: the next test's engine needs the
    last one collected (its cache then sits unused in torch's allocator, which the engine counts as free)."""
    yield
    gc.collect()


GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
SLOTS, IN, OUT = 3, 200, 136
SEGMENTS = torch.tensor([(0, 5, 1), (5, 6, 0), (9, 30, 2), (30, 31, 1)], dtype=torch.int32)  # rows 6-8, 31-33 bare


def _lora_weights(rank: int):
    gen = torch.Generator().manual_seed(0)
    return torch.randn(SLOTS, rank, IN, generator=gen) * 0.1, torch.randn(SLOTS, rank, OUT, generator=gen) * 0.1


@pytest.mark.parametrize("table_on", ["cpu", "cuda"])  # a device table is not read on the host
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("y_float", "store"), [(False, False), (True, False), (True, True)],
                         ids=["add", "add-float32", "store"])  # store needs a float32 y
def test_lora_kernel_matches_the_reference(dtype, y_float, store, table_on):
    a, b_t = _lora_weights(16)
    ranks = torch.tensor([16, 0, 5], dtype=torch.int32)  # slot 1 does not reach this projection
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(34, IN, generator=gen).to(dtype)
    y = torch.randn(34, OUT, generator=gen).to(torch.float32 if y_float else dtype)
    expected = y.clone()
    reference.lora_shrink_expand(expected, x, SEGMENTS, a, b_t, ranks, 0.5, store)
    got = y.cuda()
    ops.lora_shrink_expand(got, x.cuda(), SEGMENTS.to(table_on), a.cuda(), b_t.cuda(), ranks.cuda(), 0.5, store)
    step = 1e-5 if got.dtype == torch.float32 else 2**-7 if dtype == torch.bfloat16 else 2**-10
    torch.testing.assert_close(got.cpu().float(), expected.float(), rtol=step, atol=step)
    assert not torch.equal(got.cpu()[:6], y[:6])  # the terms are there: the check above can fail


@pytest.mark.parametrize("table_on", ["cpu", "cuda"])
def test_lora_kernel_rows_do_not_depend_on_their_segment(table_on):
    a, b_t = (w.cuda() for w in _lora_weights(64))
    x = torch.randn(71, IN, generator=torch.Generator().manual_seed(2)).bfloat16().cuda()
    segments = torch.tensor([(0, 3, 0), (3, 40, 2), (40, 41, 1), (43, 71, 0)], dtype=torch.int32)
    together = torch.zeros(71, OUT, dtype=torch.bfloat16, device="cuda")
    ops.lora_shrink_expand(together, x, segments.to(table_on), a, b_t)
    checked = 0
    for start, end, slot in segments.tolist():
        for row in range(start, end):
            alone = torch.zeros(1, OUT, dtype=torch.bfloat16, device="cuda")
            ops.lora_shrink_expand(alone, x[row:row + 1], torch.tensor([(0, 1, slot)], dtype=torch.int32), a, b_t)
            assert torch.equal(alone[0], together[row]), row
            checked += 1
    assert checked == 69 and together[41:43].eq(0).all()


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_engine_on_cuda_matches_transformers_greedy(tiny_model_dirs, arch):
    model_dir = tiny_model_dirs[arch]
    hf = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    prompts = prompts_of(hf.config.vocab_size)
    llm = LLM(model_dir, dtype="float32", device="cuda", gpu_memory_utilization=0.5)
    assert llm.engine.device.type == "cuda"
    assert _tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == hf_greedy(hf, prompts)


def test_lora_on_cuda_matches_peft(tiny_model_dirs, tmp_path):
    import peft

    base_dir = tiny_model_dirs["llama"]
    adapters = [make_adapter(base_dir, tmp_path / f"a{i}", rank, targets, seed=i)
                for i, (rank, targets) in enumerate([(8, ["q_proj", "k_proj", "v_proj", "o_proj"]),
                                                     (16, "all-linear")])]

    def hf():
        return tf.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).cuda().eval()

    prompts = prompts_of(hf().config.vocab_size)
    refs = [hf_greedy(peft.PeftModel.from_pretrained(hf(), str(a)).cuda().eval(), prompts) for a in adapters]
    base_refs = hf_greedy(hf(), prompts)
    assert all(r != base_refs for r in refs)  # the adapters change the output: the checks below can fail
    llm = LLM(base_dir, dtype="float32", device="cuda", gpu_memory_utilization=0.5, enable_lora=True,
              max_lora_rank=16, max_loras=2)
    requests = [LoRARequest(f"a{i}", i + 1, str(a)) for i, a in enumerate(adapters)]
    # Every prompt under each adapter and the base model, all in one batch: segments of both slots in each step.
    mixed = [(p, lora) for lora in [*requests, None] for p in prompts]
    outputs = llm.generate([p for p, _ in mixed], GREEDY, use_tqdm=False, lora_request=[r for _, r in mixed])
    assert _tokens(outputs) == [*refs[0], *refs[1], *base_refs]
