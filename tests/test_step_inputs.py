"""A step's input arrays onto the device in one copy (engine/step_inputs.py): the packing and views checked on a
CPU (the same code packs for a GPU, there into pinned memory), and the engine run with every step's inputs packed
against its own unpacked run."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_llm import make_prompts, tokens

from batchgen import LLM, SamplingParams
from batchgen.engine.step_inputs import ALIGN, StepInputs


def test_arrays_come_back_whole_aligned_and_in_one_buffer():
    inputs = StepInputs(torch.device("cpu"), pack=True)
    gen = np.random.default_rng(0)
    for rows in (3, 40, 2000):  # the last grows the buffers past their first size
        arrays = [gen.integers(0, 1 << 40, rows), None, gen.integers(-5, 9, (rows, 7)).astype(np.int32)[:, ::2],
                  np.empty((0, 4), dtype=np.int32), gen.integers(0, 9, rows + 1).astype(np.int32)]
        out = inputs.to_device(arrays)
        assert out[1] is None
        for a, t in zip(arrays, out, strict=True):
            if a is not None:
                assert t.dtype == torch.from_numpy(np.ascontiguousarray(a)).dtype and t.is_contiguous()
                assert np.array_equal(t.numpy(), a)
                if a.size:  # an empty tensor has no address
                    assert t.untyped_storage().data_ptr() == out[0].untyped_storage().data_ptr()
                    assert (t.data_ptr() - out[0].data_ptr()) % ALIGN == 0


def test_unpacked_on_a_cpu_by_default():
    array = np.arange(5)
    (tensor,) = StepInputs(torch.device("cpu")).to_device([array])
    assert tensor.data_ptr() == array.ctypes.data  # used where it lies


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_the_engine_on_packed_inputs_gives_the_same_tokens(tiny_model_dirs, prefix_caching):
    """Prefill chunks, mixed steps, steady decode (kept rows), n samples and preemption, every step's inputs views
    of the one buffer the next step rewrites."""
    path = tiny_model_dirs["llama"]
    options = dict(dtype="float32", block_size=8, num_gpu_blocks_override=40, max_num_batched_tokens=64,
                   max_num_seqs=16, enable_prefix_caching=prefix_caching, swap_space="4MiB")
    prompts = make_prompts(400, [3, 17, 40, 90, 130]) * 2
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
              SamplingParams(n=3, temperature=1.0, seed=4, max_tokens=24, ignore_eos=True)] * 5
    want = LLM(path, **options).generate(prompts, params, use_tqdm=False)
    llm = LLM(path, **options)
    packed = llm.llm_engine.runner._inputs = StepInputs(torch.device("cpu"), pack=True)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert packed._host.numel() > 0  # the steps' inputs went through the packed buffer
    assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in want]
    assert tokens(got) == tokens(want) and llm.stats()["swap_preemptions"] > 0
