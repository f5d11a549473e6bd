"""Builders of random paged-KV test cases shared by the kernel tests and benchmarks."""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
import torch

from batchgen import _C
from batchgen.ops import reference

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# (num_heads, num_kv_heads): MHA, GQA 4:1, MQA, SmolLM2-135M's 9:3.
HEAD_CONFIGS = ((4, 4), (8, 2), (8, 1), (9, 3))
UNUSED_BLOCK_ID = -7  # fills block-table entries past a sequence's end: never read, never checked

DEVICES = (
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
        ],
    ),
)


@contextmanager
def torch_threads(count: int):
    """torch.set_num_threads(count) for the duration of the block."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(params=_C.supported_cpu_isas())
def every_isa(request):
    """Runs a test on each instruction set's kernel table this processor has (the active one restored after);
    a test module opts in with `pytestmark = pytest.mark.usefixtures("every_isa")` and imports the fixture."""
    active = _C.cpu_isa()
    _C.set_cpu_isa(request.param)
    yield request.param
    _C.set_cpu_isa(active)


def use_isa(isa: str | None) -> None:
    """Switches the CPU kernels to `isa`'s table (None, conftest's `isas` on CUDA: nothing to switch)."""
    if isa is not None:
        _C.set_cpu_isa(isa)


def single_threaded():
    """For the reference: its many tiny torch ops gain nothing from threads, and on a busy machine
    each parallel region can wait a whole scheduler slice for its second thread."""
    return torch_threads(1)


def moe_routing(tokens: int, k: int, num_experts: int, gen: torch.Generator, idle: tuple[int, ...] = ()):
    """A mixture of experts' routing: k distinct experts a token (none of `idle`) and their weights, float32."""
    busy = torch.tensor([e for e in range(num_experts) if e not in idle])
    ids = torch.zeros(tokens, k, dtype=torch.long)
    for t in range(tokens):
        ids[t] = busy[torch.randperm(len(busy), generator=gen)[:k]]
    return ids, torch.rand(tokens, k, generator=gen)


def moe_by_expert_calls(x, ids, weights, num_experts: int, expert_rows):
    """What a one-call MoE op must equal bit for bit: `expert_rows(rows, e)` (float32) once an expert on the rows
    routed to it, each token's weighted outputs added in float32 in ascending expert order, rounded to x's dtype."""
    total = torch.zeros(x.shape, dtype=torch.float32)
    for e in range(num_experts):
        token, rank = (ids == e).nonzero(as_tuple=True)
        if len(token):
            total[token] += expert_rows(x[token], e) * weights[token, rank, None]
    return total.to(x.dtype)


def tolerance(dtype: torch.dtype, device: str = "cpu") -> float:
    """Largest allowed rel_err of a kernel against the reference. CUDA's float32 gets twice CPU's: its kernels
    are built with --use_fast_math (exp2 and division approximate to 2 ulp)."""
    if dtype != torch.float32:
        return 1e-2
    return 2e-5 if str(device).startswith("cuda") else 1e-5


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|, computed in float32."""
    actual, expected = actual.float(), expected.float()
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()


def subnormal_count(t: torch.Tensor) -> int:
    """How many of t's values are subnormal in float32 (nonzero and below its smallest normal): the values the
    AVX512-BF16 tables' bf16 conversion would flush to zero, which tests of those tables need to hold."""
    magnitude = t.float().abs()
    return int(((magnitude > 0) & (magnitude < torch.finfo(torch.float32).tiny)).sum())


@dataclass
class PagedKV:
    key_cache: torch.Tensor  # [num_blocks, num_kv_heads, block_size, head_dim]
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq], shuffled physical ids
    seq_lens: torch.Tensor  # int32 [num_seqs]


def paged_kv(
    lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str,
    gen: torch.Generator,
    spare_blocks: int = 3,
) -> PagedKV:
    """Caches holding random K/V for sequences of the given lengths in randomly permuted blocks.

    Every slot that belongs to no sequence (tails of last blocks, spare blocks) holds NaN, so a
    kernel that reads past a sequence's end shows up as NaN in its output."""
    used = [math.ceil(n / block_size) for n in lens]
    num_blocks = sum(used) + spare_blocks
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    key_cache = torch.full(shape, float("nan"), dtype=dtype)
    value_cache = torch.full(shape, float("nan"), dtype=dtype)
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.full((len(lens), max(used) + 1), UNUSED_BLOCK_ID, dtype=torch.int32)
    slots = []
    taken = 0
    for i, n in enumerate(lens):
        blocks = order[taken : taken + used[i]]
        taken += used[i]
        tables[i, : used[i]] = blocks.int()
        positions = torch.arange(n)
        slots.append(blocks[positions // block_size] * block_size + positions % block_size)
    slot_mapping = torch.cat(slots)
    kv_shape = (len(slot_mapping), num_kv_heads, head_dim)
    keys = torch.randn(kv_shape, generator=gen).to(dtype)
    values = torch.randn(kv_shape, generator=gen).to(dtype)
    with single_threaded():
        reference.reshape_and_cache(keys, values, key_cache, value_cache, slot_mapping)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    return PagedKV(key_cache.to(device), value_cache.to(device), tables.to(device), seq_lens.to(device))


def random_query(num_tokens: int, num_heads: int, head_dim: int, dtype: torch.dtype, device: str, gen):
    return torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype).to(device)
