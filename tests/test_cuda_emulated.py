"""The CUDA kernels of engine_src/cuda, run on the CPU under a small emulation of the CUDA
execution model (tests/cuda_emu/emu.h), against a float64 torch reference.

The .cu sources are translated mechanically (kernel launches become emu::launch calls, dynamic
shared memory an emulated buffer), built by g++ into a shared library and called through ctypes
with CPU tensors. This checks index arithmetic, masking, the online softmax, the split-context
merge and barrier placement without a GPU; it cannot see GPU-only problems (alignment faults,
shared memory limits, timing). Skipped without g++ or the CUDA headers.
"""

from __future__ import annotations

import ctypes
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_cuda_compile import cuda_include

ROOT = Path(__file__).resolve().parents[1]
CUDA_DIR = ROOT / "engine_src" / "cuda"
EMU_DIR = Path(__file__).resolve().parent / "cuda_emu"
SOURCES = ["cache_kernels", "attention_decode", "attention_prefill", "lora_kernels"]
DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # kernels.h DType
# Max error allowed, relative to 1 + max |reference|: about two roundings of the output dtype.
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


pytestmark = pytest.mark.skipif(
    shutil.which("g++") is None or cuda_include() is None or not sys.platform.startswith("linux"),
    reason="needs g++, the CUDA headers and Linux (ucontext)",
)


def _translate(source: str) -> str:
    """Rewrites the two CUDA-only constructs the host compiler cannot take."""
    source, n = re.subn(
        r"extern\s+__shared__\s+(?:__align__\(\d+\)\s+)?([\w ]+?)\s+(\w+)\[\];",
        r"\1* \2 = reinterpret_cast<\1*>(emu::dynamic_smem());",
        source,
    )
    launch = r"([A-Za-z_]\w*(?:<[^<>;]*>)?)\s*<<<(.*?)>>>\("
    source = re.sub(launch, r"emu::launch(\1, \2)(", source, flags=re.S)
    assert "<<<" not in source, "a kernel launch was not translated"
    return source


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    build = tmp_path_factory.mktemp("cuda_emu")
    (build / "gen").mkdir()
    for name in SOURCES:
        (build / "gen" / f"{name}.cpp").write_text(_translate((CUDA_DIR / f"{name}.cu").read_text()))
    out = build / "libemu.so"
    cmd = ["g++", "-std=c++20", "-O1", "-shared", "-fPIC", "-Wall", "-Wno-unknown-pragmas",
           "-Wno-unused-function", f"-I{cuda_include()}", f"-I{CUDA_DIR}", f"-I{EMU_DIR}", f"-I{build}",
           str(EMU_DIR / "harness.cpp"), "-o", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{' '.join(cmd)}\n{result.stderr[-20000:]}"
    return _bind(ctypes.CDLL(str(out)))


def _bind(lib):
    p, i32, i64, f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
    lib.emu_reshape_and_cache.argtypes = [i32, p, p, p, p, p, i64, i32, i32, i32, i64, i64, i64, i64]
    lib.emu_copy_blocks.argtypes = [p, p, i32, p, i64, i64]
    lib.emu_decode_workspace_bytes.argtypes = [i32, i32, i32, i32, i32]
    lib.emu_decode_workspace_bytes.restype = ctypes.c_size_t
    lib.emu_decode.argtypes = [i32, p, i64, i64, p, i64, i64, p, p, p, i64, p, *[i32] * 6, f32, i32, f32, p, p]
    lib.emu_prefill.argtypes = [i32, p, i64, i64, p, i64, i64, p, p, p, i64, p, p, i32, i64, *[i32] * 4, f32, i32,
                                f32, p]
    lib.emu_prefill_limits.argtypes = [*lib.emu_prefill.argtypes, p]
    lib.emu_reshape_and_cache_fp8.argtypes = [i32, i32, p, p, p, p, p, i64, i32, i32, i32, p, p]
    lib.emu_decode_fp8.argtypes = [i32, i32, p, p, p, p, p, i64, p, *[i32] * 6, f32, p, p, p, p]
    lib.emu_prefill_fp8.argtypes = [i32, i32, p, p, p, p, p, i64, p, p, i32, i64, *[i32] * 4, f32, p, p, p]
    lib.emu_lora_workspace_bytes.argtypes = [i64, i32]
    lib.emu_lora_workspace_bytes.restype = ctypes.c_size_t
    lib.emu_lora.argtypes = [i32, i32, p, i64, p, i64, i64, p, i32, i32, p, p, p, i32, i32, i32, f32, i32, p]
    lib.emu_mma_fragments.argtypes = [i32, p, p, p, p]
    lib.emu_ldmatrix.argtypes = [p, p]
    lib.emu_ldmatrix_mma.argtypes = [i32, p, p, p, p, p]
    return lib


def ptr(t: torch.Tensor | None):
    return None if t is None else ctypes.c_void_p(t.data_ptr())


def nan_cache(num_blocks, num_kv_heads, block_size, head_dim, dtype):
    """A cache of NaNs: any read of a slot no sequence owns poisons the result."""
    return torch.full((num_blocks, num_kv_heads, block_size, head_dim), float("nan"), dtype=dtype)


def paged_sequences(seq_lens, num_kv_heads, block_size, head_dim, dtype, table_pad=1):
    """Random keys/values per sequence, scattered over shuffled cache blocks."""
    blocks = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks) + 3
    free = torch.randperm(num_blocks).tolist()
    key_cache = nan_cache(num_blocks, num_kv_heads, block_size, head_dim, dtype)
    value_cache = nan_cache(num_blocks, num_kv_heads, block_size, head_dim, dtype)
    tables = torch.full((len(seq_lens), max(blocks) + table_pad), -1, dtype=torch.int32)
    keys, values = [], []
    for i, n in enumerate(seq_lens):
        k = torch.randn(n, num_kv_heads, head_dim).to(dtype)
        v = torch.randn(n, num_kv_heads, head_dim).to(dtype)
        keys.append(k)
        values.append(v)
        for b in range(blocks[i]):
            tables[i, b] = free.pop()
        for t in range(n):
            block = tables[i, t // block_size].item()
            key_cache[block, :, t % block_size] = k[t]
            value_cache[block, :, t % block_size] = v[t]
    return key_cache, value_cache, tables, keys, values


def reference(query, keys, values, positions, scale, window=0, cap=0.0, limits=None, sinks=None):
    """query [n, H, D] attends keys/values [L, KVH, D]; row j sees positions 0..positions[j] (0..limits[j] when
    given), with a window only those after positions[j] - window; a soft cap bends scores s to cap * tanh(s / cap).
    sinks [H]: each head's attention sink, a score joining every row's softmax with a zero value (GPT-OSS)."""
    group = query.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1)
    v = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", query.double(), k) * scale
    if cap:
        scores = cap * torch.tanh(scores / cap)
    key_pos, query_pos = torch.arange(k.shape[0])[None, :], torch.tensor(positions)[:, None]
    last = query_pos if limits is None else torch.as_tensor(limits)[:, None]
    hidden = (key_pos > last) | ((key_pos <= query_pos - window) if window else False)
    scores = scores.masked_fill(hidden[None], float("-inf"))
    if sinks is not None:
        sink_column = sinks.double()[:, None, None].expand(-1, scores.shape[1], 1)
        scores = torch.cat([scores, sink_column], dim=-1)
    probs = scores.softmax(-1)[..., : k.shape[0]]
    return torch.einsum("hnl,lhd->nhd", probs, v)


def assert_close(got, want, dtype):
    assert not torch.isnan(got).any(), "NaN in the output"
    err = (got.double() - want).abs().max().item()
    assert err <= TOLERANCE[dtype] * (1 + want.abs().max().item()), f"max error {err:.3e}"


def poison_before_windows(key_cache, value_cache, tables, first_positions, window):
    """NaN into every block wholly before the window of a sequence's first query: a kernel that
    reads such a block instead of skipping it poisons its output."""
    block_size = key_cache.shape[2]
    for i, pos in enumerate(first_positions):
        for b in range(max(0, pos - window + 1) // block_size if window else 0):
            key_cache[tables[i, b]] = float("nan")
            value_cache[tables[i, b]] = float("nan")


def decode(lib, query, key_cache, value_cache, tables, seq_lens, scale, window=0, cap=0.0, sinks=None):
    """The decode kernel's output, and the bytes of workspace it asked for."""
    num_seqs, num_heads, head_dim = query.shape
    out = torch.full_like(query, float("nan"))
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    block_size = key_cache.shape[2]
    max_context = tables.shape[1] * block_size
    workspace_bytes = lib.emu_decode_workspace_bytes(num_seqs, num_heads, head_dim, max_context, window)
    workspace = torch.full((workspace_bytes // 4,), float("nan")) if workspace_bytes else None
    rc = lib.emu_decode(
        DTYPE_CODE[query.dtype], ptr(out), *out.stride()[:2], ptr(query), *query.stride()[:2],
        ptr(key_cache), ptr(value_cache), ptr(tables), tables.stride(0), ptr(lens), num_seqs, num_heads,
        key_cache.shape[1], head_dim, block_size, max_context, scale, window, cap, ptr(workspace), ptr(sinks))
    assert rc == 0
    return out, workspace_bytes


def run_decode(lib, dtype, head_dim, block_size, num_heads, num_kv_heads, seq_lens, table_pad=1, window=0, cap=0.0,
               scale=None, sinks=None):
    key_cache, value_cache, tables, keys, values = paged_sequences(
        seq_lens, num_kv_heads, block_size, head_dim, dtype, table_pad)
    poison_before_windows(key_cache, value_cache, tables, [n - 1 for n in seq_lens], window)
    scale = scale or head_dim**-0.5
    query = torch.randn(len(seq_lens), num_heads, head_dim).to(dtype)
    out, workspace_bytes = decode(lib, query, key_cache, value_cache, tables, seq_lens, scale, window, cap, sinks)
    want = [reference(query[i:i + 1], keys[i], values[i], [n - 1], scale, window, cap, sinks=sinks)
            for i, n in enumerate(seq_lens)]
    assert_close(out, torch.cat(want), dtype)
    return workspace_bytes


def run_prefill(lib, dtype, head_dim, block_size, num_heads, num_kv_heads, seq_lens, query_lens,
                strided_query=False, window=0, cap=0.0, scale=None, query_pad=0, sinks=None):
    key_cache, value_cache, tables, keys, values = paged_sequences(
        seq_lens, num_kv_heads, block_size, head_dim, dtype)
    poison_before_windows(key_cache, value_cache, tables, [n - q for n, q in zip(seq_lens, query_lens, strict=True)],
                          window)
    num_tokens, scale = sum(query_lens), scale or head_dim**-0.5
    query = torch.randn(num_tokens, num_heads + 3 * strided_query, head_dim + query_pad).to(dtype)
    query = query[:, :num_heads, :head_dim]
    out = torch.full((num_tokens, num_heads, head_dim), float("nan"), dtype=dtype)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    rc = lib.emu_prefill(
        DTYPE_CODE[dtype], ptr(out), *out.stride()[:2], ptr(query), *query.stride()[:2],
        ptr(key_cache), ptr(value_cache), ptr(tables), tables.stride(0), ptr(lens), ptr(starts),
        len(seq_lens), num_tokens, num_heads, num_kv_heads, head_dim, block_size, scale, window, cap, ptr(sinks))
    assert rc == 0
    want = []
    for i, (n, q_len) in enumerate(zip(seq_lens, query_lens, strict=True)):
        context = n - q_len
        rows = query[starts[i]:starts[i + 1]]
        want.append(reference(rows, keys[i], values[i], [context + j for j in range(q_len)], scale, window, cap,
                              sinks=sinks))
    assert_close(out, torch.cat(want), dtype)


DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HEAD_DIMS = [64, 80, 96, 128, 256]


def small_integers(*shape, gen, dtype):
    """Integers in -4..4: exact in fp16 and bf16, and so are their products' sums."""
    return torch.randint(-4, 5, shape, generator=gen).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_emulated_mma_fragments(lib, dtype):
    """The emulated m16n8k16 MMA, fed fragments built from the PTX ISA's layouts, is a @ b + c: exactly on
    integers, to float rounding on random values."""
    gen = torch.Generator().manual_seed(11)
    bf16 = int(dtype == torch.bfloat16)
    for exact in (True, False):
        make = (lambda *s: small_integers(*s, gen=gen, dtype=dtype)) if exact else (
            lambda *s: torch.randn(*s, generator=gen).to(dtype))
        a, b, c = make(16, 16), make(16, 8), make(16, 8).float()
        d = torch.full((16, 8), float("nan"))
        lib.emu_mma_fragments(bf16, ptr(a), ptr(b), ptr(c), ptr(d))
        want = a.double() @ b.double() + c.double()
        if exact:
            assert torch.equal(d.double(), want)
        else:
            torch.testing.assert_close(d.double(), want, rtol=1e-6, atol=1e-6)


def test_emulated_ldmatrix_layouts(lib):
    """ldmatrix x4 and x4.trans hand lane l, register i: row l / 4 (plain) or column l / 4 (trans) of matrix i,
    elements 2 (l % 4) and the next, the lower in the low half."""
    m = torch.arange(256, dtype=torch.int16).view(4, 8, 8)
    out = torch.zeros(32, 8, dtype=torch.int32)
    lib.emu_ldmatrix(ptr(m), ptr(out))
    want = torch.zeros(32, 8, dtype=torch.int32)
    for lane in range(32):
        for i in range(4):
            r, c = lane // 4, 2 * (lane % 4)
            want[lane, i] = int(m[i, r, c]) | int(m[i, r, c + 1]) << 16
            want[lane, 4 + i] = int(m[i, c, r]) | int(m[i, c + 1, r]) << 16
    assert torch.equal(out, want)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_emulated_ldmatrix_mma(lib, dtype):
    """ldmatrix into MMA fragments as the prefill kernel pairs them: a K-like operand read plainly gives
    a @ bt^T, a V-like one read transposed gives a @ v (integers: exact)."""
    gen = torch.Generator().manual_seed(12)
    a, bt, v = (small_integers(*s, gen=gen, dtype=dtype) for s in [(16, 32), (16, 32), (32, 16)])
    x, y = torch.full((16, 16), float("nan")), torch.full((16, 16), float("nan"))
    lib.emu_ldmatrix_mma(int(dtype == torch.bfloat16), ptr(a), ptr(bt), ptr(v), ptr(x), ptr(y))
    assert torch.equal(x, (a.float() @ bt.float().T))
    assert torch.equal(y, (a.float() @ v.float()))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_decode(lib, dtype, head_dim):
    torch.manual_seed(head_dim)
    block_size = random.Random(head_dim).choice([8, 16, 32])
    run_decode(lib, dtype, head_dim, block_size, 4, 2, [1, 7, 33, 70])


@pytest.mark.parametrize(
    "dtype, head_dim, block_size, num_heads, num_kv_heads, seq_lens, table_pad",
    [
        (torch.float16, 128, 16, 2, 1, [600, 3, 257, 1000], 40),  # MQA, table wider than needed
        (torch.float32, 64, 8, 8, 2, [1300], 0),
        (torch.bfloat16, 80, 32, 3, 3, [513, 512, 511], 5),  # partition edges
    ],
)
def test_decode_split_context(lib, dtype, head_dim, block_size, num_heads, num_kv_heads, seq_lens, table_pad):
    torch.manual_seed(1)
    workspace = run_decode(lib, dtype, head_dim, block_size, num_heads, num_kv_heads, seq_lens, table_pad)
    assert workspace > 0, "these shapes should split the context"


@pytest.mark.parametrize(
    "dtype, head_dim, num_heads, num_kv_heads",
    [
        (torch.float32, 64, 40, 1),  # MQA: a group of 40 in 5 head chunks of 8
        (torch.bfloat16, 128, 14, 2),  # group 7: chunks of 4 and 3
        (torch.float16, 256, 3, 3),  # MHA at the widest head_dim: 16 lanes of 4 pieces, 2-token groups
    ],
)
def test_decode_head_chunks(lib, dtype, head_dim, num_heads, num_kv_heads):
    torch.manual_seed(8)
    run_decode(lib, dtype, head_dim, 16, num_heads, num_kv_heads, [3, 90, 300])


@pytest.mark.parametrize("dtype, window", [(torch.float32, 0), (torch.float32, 300), (torch.float16, 0)])
def test_decode_is_batch_invariant(lib, dtype, window):
    """A sequence's output bits do not depend on its neighbours: not on how long the longest context is
    (which sizes the grid and the workspace), nor on whether it shares the launch at all."""
    torch.manual_seed(9)
    seq_lens = [700, 2100, 5, 700, 256]
    key_cache, value_cache, tables, *_ = paged_sequences(seq_lens, 2, 16, 64, dtype, table_pad=3)
    query = torch.randn(len(seq_lens), 6, 64).to(dtype)
    batch, workspace = decode(lib, query, key_cache, value_cache, tables, seq_lens, 0.125, window, 1.5)
    assert workspace > 0
    for i in (0, 2, 4):
        blocks = -(-seq_lens[i] // 16)
        alone, _ = decode(lib, query[i:i + 1].clone(), key_cache, value_cache, tables[i:i + 1, :blocks].contiguous(),
                          seq_lens[i:i + 1], 0.125, window, 1.5)
        assert torch.equal(alone[0], batch[i]), i


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_prefill(lib, dtype, head_dim):
    torch.manual_seed(head_dim)
    block_size = random.Random(head_dim + 1).choice([8, 16, 32])
    # plain prefill, chunked prefill behind 17 cached tokens, a decode-like single token
    run_prefill(lib, dtype, head_dim, block_size, 4, 2, [5, 40, 9], [5, 23, 1])


@pytest.mark.parametrize(
    "dtype, head_dim, block_size, num_heads, num_kv_heads, seq_lens, query_lens, strided",
    [
        (torch.float16, 64, 16, 14, 2, [50, 30, 12], [50, 0, 12], False),  # group 7, an empty query
        (torch.float32, 128, 8, 40, 1, [20, 3], [4, 3], True),  # MQA group 40 > rows per tile
        (torch.bfloat16, 64, 8, 40, 1, [20, 3], [4, 3], True),  # the same on tensor cores, strided query
        (torch.bfloat16, 96, 32, 4, 4, [130, 70, 1], [70, 33, 1], False),  # MHA, many key tiles
        (torch.float32, 256, 16, 2, 1, [100, 45], [64, 45], False),  # fp32 head_dim 256: 4 rows per warp
    ],
)
def test_prefill_shapes(
    lib, dtype, head_dim, block_size, num_heads, num_kv_heads, seq_lens, query_lens, strided
):
    torch.manual_seed(2)
    run_prefill(lib, dtype, head_dim, block_size, num_heads, num_kv_heads, seq_lens, query_lens, strided)


# Sliding windows and soft caps: (dtype, head_dim, block_size, num_heads, num_kv_heads, window, cap, scale).
VARIANTS = [
    (torch.float32, 64, 16, 4, 2, 37, 0.0, 0.3),  # window across blocks, not on a chunk or tile boundary
    (torch.float32, 128, 8, 8, 1, 1, 0.0, 0.1),  # a window of one key, MQA
    (torch.bfloat16, 80, 32, 3, 3, 0, 2.0, 0.5),  # soft cap alone (saturating)
    (torch.float16, 96, 16, 14, 2, 20, 30.0, 0.2),  # both, group 7
    (torch.float32, 256, 8, 2, 1, 500, 5.0, 0.125),  # a window longer than every sequence
]


@pytest.mark.parametrize("dtype, head_dim, block_size, num_heads, num_kv_heads, window, cap, scale", VARIANTS)
def test_decode_variants(lib, dtype, head_dim, block_size, num_heads, num_kv_heads, window, cap, scale):
    torch.manual_seed(5)
    run_decode(lib, dtype, head_dim, block_size, num_heads, num_kv_heads, [1, 7, 33, 70, 161], window=window,
               cap=cap, scale=scale)


@pytest.mark.parametrize("dtype, window", [(torch.float32, 600), (torch.bfloat16, 257), (torch.float16, 45)])
def test_decode_split_context_with_a_window(lib, dtype, window):
    """Partitions cover the window only: split when it is long, one partition when it is short."""
    torch.manual_seed(6)
    workspace = run_decode(lib, dtype, 64, 16, 2, 1, [1300, 20, 700], window=window, cap=10.0)
    assert (workspace > 0) == (window > 256)


# More for the tensor-core prefill (fp16/bf16): windows across its 64-key tiles, head_dim 256's 32-key tiles.
TENSOR_CORE_VARIANTS = [
    (torch.bfloat16, 64, 8, 4, 2, 37, 0.0, 0.3),
    (torch.float16, 256, 32, 2, 1, 45, 10.0, 0.1),
    (torch.bfloat16, 128, 16, 7, 1, 70, 0.0, 0.15),  # group 7, a window longer than a tile
]


@pytest.mark.parametrize("dtype, head_dim, block_size, num_heads, num_kv_heads, window, cap, scale",
                         VARIANTS + TENSOR_CORE_VARIANTS)
def test_prefill_variants(lib, dtype, head_dim, block_size, num_heads, num_kv_heads, window, cap, scale):
    torch.manual_seed(7)
    # plain prefill, chunks behind a cached context across the window's edge, a single token
    run_prefill(lib, dtype, head_dim, block_size, num_heads, num_kv_heads, [50, 90, 9, 130], [50, 23, 1, 40],
                window=window, cap=cap, scale=scale)


# Key limits (Gemma 3's image tokens see their whole image): images within a 64-key tile, across tiles (the
# tensor-core kernel's), starting in the cached context (a chunk after a prefix-cache hit), with windows.
KEY_LIMIT_CASES = [
    (torch.float32, 64, 16, 4, 2, 0),
    (torch.float32, 128, 8, 8, 1, 7),
    (torch.float16, 64, 16, 4, 2, 0),
    (torch.bfloat16, 128, 32, 7, 1, 20),
    (torch.float16, 256, 16, 2, 1, 45),
]


@pytest.mark.parametrize("dtype, head_dim, block_size, num_heads, num_kv_heads, window", KEY_LIMIT_CASES)
def test_prefill_key_limits(lib, dtype, head_dim, block_size, num_heads, num_kv_heads, window):
    torch.manual_seed(8)
    seq_lens, query_lens = [60, 200, 9, 150], [60, 180, 1, 70]
    images = [[(3, 20), (30, 34)], [(15, 25), (40, 140), (150, 190)], [], [(75, 90), (100, 101), (120, 149)]]
    key_cache, value_cache, tables, keys, values = paged_sequences(seq_lens, num_kv_heads, block_size, head_dim, dtype)
    poison_before_windows(key_cache, value_cache, tables, [n - q for n, q in zip(seq_lens, query_lens, strict=True)],
                          window)
    num_tokens, scale = sum(query_lens), head_dim**-0.5
    query = torch.randn(num_tokens, num_heads, head_dim).to(dtype)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    positions = [list(range(n - q, n)) for n, q in zip(seq_lens, query_lens, strict=True)]
    limits = [[next((end - 1 for start, end in spans if start <= p < end), p) for p in own]
              for own, spans in zip(positions, images, strict=True)]
    limit_tensor = torch.tensor([x for row in limits for x in row], dtype=torch.int32)

    def launch(key_limit):
        result = torch.full_like(query, float("nan"))
        rc = lib.emu_prefill_limits(
            DTYPE_CODE[dtype], ptr(result), *result.stride()[:2], ptr(query), *query.stride()[:2],
            ptr(key_cache), ptr(value_cache), ptr(tables), tables.stride(0), ptr(lens), ptr(starts),
            len(seq_lens), num_tokens, num_heads, num_kv_heads, head_dim, block_size, scale, window, 0.0, None,
            ptr(key_limit))
        assert rc == 0
        return result

    out = launch(limit_tensor)
    # Limits outside [position, seq_len - 1] are kept within it (the host does not check the device's values).
    own = torch.tensor([p for row in positions for p in row], dtype=torch.int32)
    ends = torch.repeat_interleave(lens, torch.tensor(query_lens))
    skewed = torch.where(limit_tensor == own, own - 3, limit_tensor)
    skewed = torch.where(own == ends - 1, ends + 7, skewed)
    assert torch.equal(launch(skewed.int()), out)
    want, causal = [], []
    for i in range(len(seq_lens)):
        rows = query[starts[i]:starts[i + 1]]
        want.append(reference(rows, keys[i], values[i], positions[i], scale, window, limits=limits[i]))
        causal.append(reference(rows, keys[i], values[i], positions[i], scale, window))
    assert_close(out, torch.cat(want), dtype)
    assert not torch.allclose(torch.cat(want), torch.cat(causal))  # the limits changed the result



def sink_values(num_heads: int) -> torch.Tensor:
    """Attention sinks (GPT-OSS) for `num_heads` heads: from well below the scores to well above them, so that
    some heads' rows give the sink most of their weight and others almost none."""
    return torch.linspace(-6.0, 8.0, num_heads) + 0.1 * torch.randn(num_heads)


# Attention sinks: (dtype, head_dim, block_size, num_heads, num_kv_heads, seq_lens, window). Decode's split context
# (the sink joined once, at the merge) and its head chunks; the prefill's CUDA-core (float32) and tensor-core kernels.
SINK_CASES = [
    (torch.float32, 64, 16, 8, 2, [1, 9, 70], 0),
    (torch.float32, 64, 16, 8, 2, [1300, 5], 0),  # float32's tight tolerance over a split context
    (torch.bfloat16, 64, 16, 40, 1, [600, 3, 1000], 0),  # head chunks; split contexts
    (torch.float16, 128, 8, 14, 2, [1300, 33], 128),  # group 7; GPT-OSS's window of 128
]


@pytest.mark.parametrize("dtype, head_dim, block_size, num_heads, num_kv_heads, seq_lens, window", SINK_CASES)
def test_decode_sinks(lib, dtype, head_dim, block_size, num_heads, num_kv_heads, seq_lens, window):
    torch.manual_seed(13)
    sinks = sink_values(num_heads)
    workspace = run_decode(lib, dtype, head_dim, block_size, num_heads, num_kv_heads, seq_lens, window=window,
                           sinks=sinks)
    assert (workspace > 0) == (max(seq_lens) > 512 and window == 0)  # the split path ran where it should


@pytest.mark.parametrize("dtype, head_dim, block_size, num_heads, num_kv_heads, seq_lens, window", SINK_CASES)
def test_prefill_sinks(lib, dtype, head_dim, block_size, num_heads, num_kv_heads, seq_lens, window):
    torch.manual_seed(14)
    sinks = sink_values(num_heads)
    lens = [n if n < 200 else 150 for n in seq_lens]
    run_prefill(lib, dtype, head_dim, block_size, num_heads, num_kv_heads, lens, [min(n, 40) for n in lens],
                window=window, sinks=sinks)


def test_sinks_change_the_output(lib):
    """The sink case is not vacuous: the same decode without sinks differs from the reference with them."""
    torch.manual_seed(15)
    key_cache, value_cache, tables, keys, values = paged_sequences([40], 2, 16, 64, torch.float32)
    query = torch.randn(1, 4, 64)
    sinks = torch.tensor([3.0, 0.0, -3.0, 5.0])
    with_sinks, _ = decode(lib, query, key_cache, value_cache, tables, [40], 0.125, sinks=sinks)
    without, _ = decode(lib, query, key_cache, value_cache, tables, [40], 0.125)
    assert_close(with_sinks, reference(query, keys[0], values[0], [39], 0.125, sinks=sinks), torch.float32)
    assert (with_sinks - without).abs().max() > 1e-2

def test_prefill_unaligned_rows_take_the_cuda_core_kernel(lib):
    """Query heads 68 elements apart (rows not on 16-byte boundaries) cannot be copied with cp.async: the fp16
    launch falls back to the CUDA-core kernel, still right."""
    torch.manual_seed(8)
    run_prefill(lib, torch.float16, 64, 16, 4, 2, [30, 20], [30, 7], strided_query=True, query_pad=4)


def test_prefill_below_sm80_takes_the_cuda_core_kernel(lib, monkeypatch):
    """The tensor-core kernel needs sm_80: on an (emulated) sm_75 the bf16 launch runs the CUDA-core kernel,
    whose bits differ, on sm_80 and sm_90 the tensor-core one, the same bits on both."""
    torch.manual_seed(10)
    key_cache, value_cache, tables, keys, values = paged_sequences([70, 9], 2, 16, 64, torch.bfloat16)
    queries = [torch.randn(n, 4, 64).to(torch.bfloat16) for n in (70, 9)]
    outs = {}
    for major in (7, 8, 9):
        monkeypatch.setenv("BATCHGEN_EMU_CC_MAJOR", str(major))
        outs[major] = _prefill_parts(lib, torch.bfloat16, (key_cache, value_cache, tables),
                                     [(0, 0, queries[0]), (1, 0, queries[1])], 4, 0.125, 0, 0.0)
    for out in outs.values():
        for i, n in enumerate((70, 9)):
            assert_close(out[i], reference(queries[i], keys[i], values[i], list(range(n)), 0.125), torch.bfloat16)
    assert torch.equal(outs[8][0], outs[9][0]) and torch.equal(outs[8][1], outs[9][1])
    assert not torch.equal(outs[7][0], outs[9][0])


def _prefill_parts(lib, dtype, caches, parts, num_heads, scale, window, cap):
    """One prefill launch of `parts` [(sequence, first position, query rows)] over the paged `caches`;
    the output rows of each part."""
    key_cache, value_cache, tables = caches
    num_kv_heads, block_size, head_dim = key_cache.shape[1:]
    query = torch.cat([q for _, _, q in parts])
    out = torch.full_like(query, float("nan"))
    lengths = [len(q) for _, _, q in parts]
    starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor([first + len(q) for _, first, q in parts], dtype=torch.int32)
    part_tables = tables[[i for i, _, _ in parts]].contiguous()
    rc = lib.emu_prefill(
        DTYPE_CODE[dtype], ptr(out), *out.stride()[:2], ptr(query), *query.stride()[:2], ptr(key_cache),
        ptr(value_cache), ptr(part_tables), part_tables.stride(0), ptr(lens), ptr(starts), len(parts), len(query),
        num_heads, num_kv_heads, head_dim, block_size, scale, window, cap, None)
    assert rc == 0
    return out.split(lengths)


@pytest.mark.parametrize(
    "dtype, head_dim, block_size, num_heads, num_kv_heads, window, cap",
    [
        (torch.bfloat16, 64, 16, 4, 2, 0, 0.0),
        (torch.float16, 128, 8, 14, 2, 0, 0.0),  # group 7: a token's rows straddle warps and blocks
        (torch.bfloat16, 80, 32, 3, 3, 45, 20.0),  # window and soft cap
        (torch.float32, 64, 16, 4, 1, 0, 0.0),
    ],
)
def test_prefill_batch_invariance(lib, dtype, head_dim, block_size, num_heads, num_kv_heads, window, cap):
    """A query row's output bits depend on its sequence's cached keys and its own query only: the whole prompt
    alone, the prompt beside other sequences, and the prompt in chunks (one of a single token) behind its
    cached context beside other neighbours give identical rows."""
    torch.manual_seed(9)
    seq_lens = [150, 70, 33]
    key_cache, value_cache, tables, _, _ = paged_sequences(seq_lens, num_kv_heads, block_size, head_dim, dtype)
    caches = (key_cache, value_cache, tables)
    queries = [torch.randn(n, num_heads, head_dim).to(dtype) for n in seq_lens]
    scale = head_dim**-0.5

    def run(parts):
        return _prefill_parts(lib, dtype, caches, parts, num_heads, scale, window, cap)

    (alone,) = run([(0, 0, queries[0])])
    _, beside, _ = run([(1, 0, queries[1]), (0, 0, queries[0]), (2, 10, queries[2][10:])])
    assert torch.equal(beside, alone)
    chunks = [(0, 37), (37, 100), (100, 101), (101, 150)]
    for n, (first, end) in enumerate(chunks):
        neighbours = [(2, 0, queries[2][:5 + 9 * n]), (1, 60 - 20 * n, queries[1][60 - 20 * n:63])]
        parts = neighbours[: n % 3] + [(0, first, queries[0][first:end])] + neighbours[n % 3:]
        got = run(parts)[n % 3]
        assert torch.equal(got, alone[first:end]), (first, end)
    assert not torch.isnan(alone.float()).any()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim, block_size, num_kv_heads, strided", [(80, 8, 2, False), (80, 8, 2, True),
                                                                         (64, 16, 3, False)])
def test_reshape_and_cache(lib, dtype, head_dim, block_size, num_kv_heads, strided):
    torch.manual_seed(3)
    num_blocks, num_tokens = 6, 11
    key_cache = nan_cache(num_blocks, num_kv_heads, block_size, head_dim, dtype)
    value_cache = nan_cache(num_blocks, num_kv_heads, block_size, head_dim, dtype)
    qkv = torch.randn(num_tokens, 3 * num_kv_heads, head_dim).to(dtype)
    key, value = qkv[:, :num_kv_heads], qkv[:, num_kv_heads:2 * num_kv_heads]
    if not strided:
        key, value = key.contiguous(), value.contiguous()
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[::3] = -1  # padding tokens are skipped
    rc = lib.emu_reshape_and_cache(DTYPE_CODE[dtype], ptr(key), ptr(value), ptr(key_cache), ptr(value_cache),
                                   ptr(slots), num_tokens, num_kv_heads, head_dim, block_size, key.stride(0),
                                   key.stride(1), value.stride(0), value.stride(1))
    assert rc == 0
    by_slot = lambda cache: cache.permute(0, 2, 1, 3).reshape(num_blocks * block_size, num_kv_heads, head_dim)
    keys_by_slot, values_by_slot = by_slot(key_cache), by_slot(value_cache)
    kept = slots >= 0
    assert torch.equal(keys_by_slot[slots[kept]], key[kept])
    assert torch.equal(values_by_slot[slots[kept]], value[kept])
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots[kept]] = False
    assert torch.isnan(keys_by_slot[untouched].float()).all()
    assert torch.isnan(values_by_slot[untouched].float()).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_copy_blocks(lib, dtype):
    torch.manual_seed(4)
    layers = 3
    key_caches = [torch.randn(8, 2, 16, 64).to(dtype) for _ in range(layers)]
    value_caches = [torch.randn(8, 2, 16, 64).to(dtype) for _ in range(layers)]
    expected = [c.clone() for c in key_caches + value_caches]
    mapping = torch.tensor([[0, 5], [3, 1], [7, 2]], dtype=torch.int64)
    for src, dst in mapping.tolist():
        for cache in expected:
            cache[dst] = cache[src]
    key_ptrs = (ctypes.c_void_p * layers)(*[c.data_ptr() for c in key_caches])
    value_ptrs = (ctypes.c_void_p * layers)(*[c.data_ptr() for c in value_caches])
    block_bytes = key_caches[0][0].numel() * key_caches[0].element_size()
    assert lib.emu_copy_blocks(key_ptrs, value_ptrs, layers, ptr(mapping), len(mapping), block_bytes) == 0
    for got, want in zip(key_caches + value_caches, expected, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("store", [False, True])
def test_lora_shrink_expand(lib, dtype, store):
    """The SGMV kernels against batchgen.ops.reference (the CPU op's torch reference): segments of 1 to 37 rows
    over three slots of ranks 16, 0 and 5 (capacity 16), rows without an adapter between them; then every row
    alone gives the bits it gave in the batch."""
    from batchgen.ops import reference as ops_reference

    gen = torch.Generator().manual_seed(0)
    rows, n_in, n_out, capacity = 50, 72, 200, 16
    a = torch.randn(3, capacity, n_in, generator=gen) * 0.1
    b_t = torch.randn(3, capacity, n_out, generator=gen) * 0.1
    ranks = torch.tensor([16, 0, 5], dtype=torch.int32)
    x = torch.randn(rows, n_in, generator=gen).to(dtype)
    segments = torch.tensor([[0, 1, 2], [1, 38, 0], [38, 40, 1], [43, 50, 2]], dtype=torch.int32)
    y_dtype = torch.float32 if store else dtype
    start = torch.randn(rows, n_out, generator=gen).to(y_dtype)

    def run(y, xs, segs):
        workspace = torch.empty(lib.emu_lora_workspace_bytes(xs.shape[0], capacity), dtype=torch.uint8)
        longest = int((segs[:, 1] - segs[:, 0]).max()) if len(segs) else 0
        status = lib.emu_lora(DTYPE_CODE[dtype], int(y.dtype == torch.float32), ptr(y), y.stride(0), ptr(xs),
                              xs.stride(0), xs.shape[0], ptr(segs), len(segs), longest, ptr(a), ptr(b_t), ptr(ranks),
                              capacity, n_in, n_out, 0.5, int(store), ptr(workspace))
        assert status == 0

    got = start.clone()
    run(got, x, segments)
    want = start.clone()
    ops_reference.lora_shrink_expand(want, x, segments, a, b_t, ranks, 0.5, store)
    assert_close(got, want.double(), dtype)
    if store:
        assert torch.equal(got[38:43].view(torch.int32), torch.full((5, n_out), -0.0).view(torch.int32))
    else:
        assert torch.equal(got[38:43], start[38:43]) and not torch.equal(got[1:38], start[1:38])
    for row in (0, 1, 17, 37, 45, 49):
        slot = next(int(s) for b, e, s in segments.tolist() if b <= row < e)
        alone = start[row:row + 1].clone()
        run(alone, x[row:row + 1], torch.tensor([[0, 1, slot]], dtype=torch.int32))
        assert torch.equal(alone[0], got[row]), row


# --- fp8 KV caches (kv_format): written quantized, read widened, scales per kv head ---------------

FP8_CODE = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}  # fp8.h KVFormat
FP8_LIMIT = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
FP8_FORMATS = list(FP8_CODE)


def quantized(x: torch.Tensor, scale: torch.Tensor, fp8: torch.dtype) -> torch.Tensor:
    """x [n, kv_heads, d] as torch's fp8 of x / scale[head], saturated (batchgen.ops.reference's rule)."""
    limit = FP8_LIMIT[fp8]
    return (x.float() / scale[None, :, None]).clamp(-limit, limit).to(fp8)


def fp8_sequences(seq_lens, num_kv_heads, block_size, head_dim, fp8, gen):
    """paged_sequences' layout with fp8 caches; keys and values as the reference reads them back (float64)."""
    blocks = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks) + 2
    free = torch.randperm(num_blocks, generator=gen).tolist()
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    key_cache, value_cache = torch.full(shape, float("nan")).to(fp8), torch.full(shape, float("nan")).to(fp8)
    k_scale = torch.rand(num_kv_heads, generator=gen) * 0.2 + 0.05
    v_scale = torch.rand(num_kv_heads, generator=gen) * 0.2 + 0.05
    tables = torch.full((len(seq_lens), max(blocks) + 1), -1, dtype=torch.int32)
    keys, values = [], []
    for i, n in enumerate(seq_lens):
        k = quantized(torch.randn(n, num_kv_heads, head_dim, generator=gen), k_scale, fp8)
        v = quantized(torch.randn(n, num_kv_heads, head_dim, generator=gen), v_scale, fp8)
        keys.append(k.double() * k_scale.double()[None, :, None])
        values.append(v.double() * v_scale.double()[None, :, None])
        for b in range(blocks[i]):
            tables[i, b] = free.pop()
        for t in range(n):
            key_cache[tables[i, t // block_size], :, t % block_size] = k[t]
            value_cache[tables[i, t // block_size], :, t % block_size] = v[t]
    return key_cache, value_cache, k_scale, v_scale, tables, keys, values


def decode_fp8(lib, query, key_cache, value_cache, k_scale, v_scale, tables, seq_lens, scale, sinks=None):
    num_seqs, num_heads, head_dim = query.shape
    out = torch.full_like(query, float("nan"))
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    max_context = tables.shape[1] * key_cache.shape[2]
    workspace_bytes = lib.emu_decode_workspace_bytes(num_seqs, num_heads, head_dim, max_context, 0)
    workspace = torch.full((workspace_bytes // 4,), float("nan")) if workspace_bytes else None
    rc = lib.emu_decode_fp8(DTYPE_CODE[query.dtype], FP8_CODE[key_cache.dtype], ptr(out), ptr(query),
                            ptr(key_cache), ptr(value_cache), ptr(tables), tables.stride(0), ptr(lens), num_seqs,
                            num_heads, key_cache.shape[1], head_dim, key_cache.shape[2], max_context, scale,
                            ptr(k_scale), ptr(v_scale), ptr(workspace), ptr(sinks))
    assert rc == 0
    return out


@pytest.mark.parametrize("fp8", FP8_FORMATS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reshape_and_cache_fp8(lib, dtype, fp8):
    """The write kernel's bytes are torch's conversion of x / scale, saturated; padding slots are skipped."""
    gen = torch.Generator().manual_seed(2)
    num_tokens, kv_heads, head_dim, block_size = 12, 2, 64, 8
    key = (torch.randn(num_tokens, kv_heads, head_dim, generator=gen) * 30).to(dtype)
    key[0, 0, :4] = torch.tensor([1e6, -1e6, 1e-9, 0.0])  # past both ends, below the smallest subnormal
    value = torch.randn(num_tokens, kv_heads, head_dim, generator=gen).to(dtype)
    k_scale, v_scale = torch.tensor([0.5, 2.0]), torch.tensor([0.25, 1.0])
    slots = torch.randperm(4 * block_size, generator=gen)[:num_tokens]
    slots[3] = -1
    key_cache = torch.zeros(4, kv_heads, block_size, head_dim, dtype=fp8)
    value_cache = torch.zeros_like(key_cache)
    rc = lib.emu_reshape_and_cache_fp8(DTYPE_CODE[dtype], FP8_CODE[fp8], ptr(key), ptr(value), ptr(key_cache),
                                       ptr(value_cache), ptr(slots), num_tokens, kv_heads, head_dim, block_size,
                                       ptr(k_scale), ptr(v_scale))
    assert rc == 0
    want_k, want_v = torch.zeros_like(key_cache), torch.zeros_like(value_cache)
    keep = slots >= 0
    blocks, offsets = slots[keep] // block_size, slots[keep] % block_size
    want_k[blocks, :, offsets] = quantized(key[keep], k_scale, fp8)
    want_v[blocks, :, offsets] = quantized(value[keep], v_scale, fp8)
    assert torch.equal(key_cache.view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(value_cache.view(torch.uint8), want_v.view(torch.uint8))


@pytest.mark.parametrize("fp8", FP8_FORMATS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_fp8(lib, dtype, fp8, head_dim):
    """Decode over fp8 caches (8-byte pieces, widened in registers, split contexts merged) against the
    reference on the dequantized K/V; a sequence's bits are the same alone as beside others."""
    gen = torch.Generator().manual_seed(head_dim)
    seq_lens, num_heads, num_kv_heads = [1, 37, 300], 6, 2
    key_cache, value_cache, k_scale, v_scale, tables, keys, values = fp8_sequences(
        seq_lens, num_kv_heads, 16, head_dim, fp8, gen)
    query = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5
    out = decode_fp8(lib, query, key_cache, value_cache, k_scale, v_scale, tables, seq_lens, scale)
    want = [reference(query[i:i + 1], keys[i], values[i], [n - 1], scale) for i, n in enumerate(seq_lens)]
    assert_close(out, torch.cat(want), dtype)
    alone = decode_fp8(lib, query[1:2], key_cache, value_cache, k_scale, v_scale, tables[1:2], seq_lens[1:2], scale)
    assert torch.equal(alone[0], out[1])


def prefill_fp8(lib, query, key_cache, value_cache, k_scale, v_scale, tables, seq_lens, query_lens, scale,
                num_heads, sinks=None):
    """One prefill launch over fp8 caches: sequence i's last query_lens[i] tokens, its keys seq_lens[i]."""
    num_kv_heads, block_size, head_dim = key_cache.shape[1:]
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    out = torch.full((query.shape[0], num_heads, head_dim), float("nan"), dtype=query.dtype)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    rc = lib.emu_prefill_fp8(DTYPE_CODE[query.dtype], FP8_CODE[key_cache.dtype], ptr(out), ptr(query),
                             ptr(key_cache), ptr(value_cache), ptr(tables), tables.stride(0), ptr(lens), ptr(starts),
                             len(lens), query.shape[0], num_heads, num_kv_heads, head_dim, block_size, scale,
                             ptr(k_scale), ptr(v_scale), ptr(sinks))
    assert rc == 0
    return out


@pytest.mark.parametrize("fp8", FP8_FORMATS, ids=str)
@pytest.mark.parametrize("dtype, head_dim", [(torch.float32, 64), (torch.float16, 64), (torch.bfloat16, 64),
                                             (torch.bfloat16, 80), (torch.float16, 128), (torch.bfloat16, 256)],
                         ids=str)
def test_prefill_fp8(lib, dtype, head_dim, fp8):
    """Prefill and a chunk behind cached context over fp8 caches against the reference; the chunked rows are the
    whole prompt's bit for bit. fp16 and bf16 run the tensor-core kernel (the tiles' bytes copied with cp.async,
    then widened into its swizzled tiles: 64-key tiles, 32 at head_dim 128 and 256, five chunks a row at 80),
    float32 the CUDA-core one (tiles widened as they are gathered)."""
    gen = torch.Generator().manual_seed(11)
    seq_lens, num_heads, num_kv_heads = [70, 45], 4, 2
    key_cache, value_cache, k_scale, v_scale, tables, keys, values = fp8_sequences(
        seq_lens, num_kv_heads, 16, head_dim, fp8, gen)
    scale = 0.125
    queries = [torch.randn(n, num_heads, head_dim, generator=gen).to(dtype) for n in seq_lens]
    whole = prefill_fp8(lib, torch.cat(queries), key_cache, value_cache, k_scale, v_scale, tables, seq_lens,
                        seq_lens, scale, num_heads)
    want = [reference(q, keys[i], values[i], list(range(len(q))), scale) for i, q in enumerate(queries)]
    assert_close(whole, torch.cat(want), dtype)
    chunk = prefill_fp8(lib, queries[1][20:].contiguous(), key_cache, value_cache, k_scale, v_scale,
                        tables[1:].contiguous(), seq_lens[1:], [25], scale, num_heads)  # 20 tokens cached in front
    assert torch.equal(chunk, whole[70 + 20:])


@pytest.mark.parametrize("fp8", FP8_FORMATS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_fp8_byte_reads_back_exactly(lib, monkeypatch, dtype, fp8):
    """Attention over one key returns its value row: every byte of the format (e4m3's NaN, never written, aside;
    e5m2's infinities and NaNs included) comes back as torch widens it, in prefill on the tensor cores (fp16,
    bf16) and on the CUDA cores, and in decode."""
    codes = torch.arange(256, dtype=torch.uint8)
    if fp8 == torch.float8_e4m3fn:
        codes = codes[(codes & 0x7F) != 0x7F]
    codes = torch.cat([codes, codes[: -len(codes) % 64]])  # whole rows of 64
    seqs, head_dim = len(codes) // 64, 64
    key_cache = torch.ones(seqs, 1, 16, head_dim).to(fp8)
    value_cache = torch.zeros(seqs, 1, 16, head_dim).to(fp8)
    value_cache.view(torch.uint8)[:, 0, 0] = codes.view(seqs, head_dim)
    tables = torch.arange(seqs, dtype=torch.int32)[:, None]
    query = torch.randn(seqs, 2, head_dim).to(dtype)
    ones = torch.ones(1)
    want = value_cache[:, 0, 0].to(dtype)[:, None].expand(seqs, 2, head_dim)
    for major in (7, 9):
        monkeypatch.setenv("BATCHGEN_EMU_CC_MAJOR", str(major))
        got = prefill_fp8(lib, query, key_cache, value_cache, ones, ones, tables, [1] * seqs, [1] * seqs, 0.125, 2)
        assert torch.allclose(got.float(), want.float(), equal_nan=True, rtol=0, atol=0), major
    got = decode_fp8(lib, query, key_cache, value_cache, ones, ones, tables, [1] * seqs, 0.125)
    assert torch.allclose(got.float(), want.float(), equal_nan=True, rtol=0, atol=0)


@pytest.mark.parametrize("fp8", FP8_FORMATS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_fp8_gives_the_bits_of_a_cache_holding_its_values(lib, monkeypatch, dtype, fp8):
    """With scales of 1 an fp8 cache's prefill is, bit for bit, that of a cache of the activations' dtype holding
    the same values (the widening is exact and the sums run in the same order): on the tensor cores (sm_80,
    sm_90) and on the CUDA cores (sm_75), whose bits differ from each other. So is its decode."""
    gen = torch.Generator().manual_seed(12)
    seq_lens, num_heads, num_kv_heads, head_dim = [100, 33], 6, 2, 64
    key_cache, value_cache, _, _, tables, _, _ = fp8_sequences(seq_lens, num_kv_heads, 16, head_dim, fp8, gen)
    ones = torch.ones(num_kv_heads)
    queries = [torch.randn(n, num_heads, head_dim, generator=gen).to(dtype) for n in seq_lens]
    query = torch.cat(queries)
    same = (key_cache.to(dtype), value_cache.to(dtype), tables)
    outs = {}
    for major in (7, 8, 9):
        monkeypatch.setenv("BATCHGEN_EMU_CC_MAJOR", str(major))
        got = prefill_fp8(lib, query, key_cache, value_cache, ones, ones, tables, seq_lens, seq_lens, 0.125,
                          num_heads)
        want = torch.cat(_prefill_parts(lib, dtype, same, [(i, 0, q) for i, q in enumerate(queries)], num_heads,
                                        0.125, 0, 0.0))
        assert not torch.isnan(got.float()).any()
        assert torch.equal(got, want), major
        outs[major] = got
    assert torch.equal(outs[8], outs[9]) and not torch.equal(outs[7], outs[8])
    last = torch.stack([q[-1] for q in queries])
    got = decode_fp8(lib, last, key_cache, value_cache, ones, ones, tables, seq_lens, 0.125)
    want, _ = decode(lib, last, *same, seq_lens, 0.125)
    assert torch.equal(got, want)


@pytest.mark.parametrize("fp8", FP8_FORMATS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_sinks_over_fp8_caches(lib, dtype, fp8):
    """Attention sinks over fp8 caches (the values' scale applied apart from the sink's zero value): decode with a
    split context, prefill on the CUDA-core (float32) and tensor-core (bf16) kernels."""
    gen = torch.Generator().manual_seed(16)
    seq_lens, num_heads, num_kv_heads = [3, 70, 700], 8, 2
    key_cache, value_cache, k_scale, v_scale, tables, keys, values = fp8_sequences(
        seq_lens, num_kv_heads, 16, 64, fp8, gen)
    sinks = sink_values(num_heads)
    query = torch.randn(len(seq_lens), num_heads, 64, generator=gen).to(dtype)
    out = decode_fp8(lib, query, key_cache, value_cache, k_scale, v_scale, tables, seq_lens, 0.125, sinks)
    want = [reference(query[i:i + 1], keys[i], values[i], [n - 1], 0.125, sinks=sinks) for i, n in enumerate(seq_lens)]
    assert_close(out, torch.cat(want), dtype)
    queries = [torch.randn(n, num_heads, 64, generator=gen).to(dtype) for n in seq_lens[:2]]
    out = prefill_fp8(lib, torch.cat(queries), key_cache, value_cache, k_scale, v_scale, tables[:2].contiguous(),
                      seq_lens[:2], seq_lens[:2], 0.125, num_heads, sinks)
    want = [reference(q, keys[i], values[i], list(range(len(q))), 0.125, sinks=sinks) for i, q in enumerate(queries)]
    assert_close(out, torch.cat(want), dtype)

