"""The CPU attention kernels give a query row bit-identical results however its step is made up.

A row's output may depend only on its query, its position and the K/V of its own keys: not on
how its prompt was chunked, whether it is computed by prefill or by decode, which other rows or
sequences share the call, which physical blocks hold its keys, whether its keys are shared with
other samples (`seq_groups`), or how many threads run the call. The engine's seeded
reproducibility (prefix cache, preemption, batch size, shards, resume) rests on this.
"""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DTYPES, torch_threads

from batchgen import ops

BLOCK_SIZE = 16
SEQ_LEN = 300  # several 64-key tiles, and a last partial block
# (num_heads, num_kv_heads, head_dim): SmolLM2's heads, GQA 4:1 with a half chunk of the pair path
SHAPES = ((9, 3, 64), (8, 2, 80))


class Cache:
    """A K/V cache with a pool of blocks handed out in a random order."""

    def __init__(self, num_kv_heads: int, head_dim: int, dtype: torch.dtype, num_blocks: int = 400,
                 block_size: int = BLOCK_SIZE):
        gen = torch.Generator().manual_seed(1)
        shape = (num_blocks, num_kv_heads, block_size, head_dim)
        self.k = torch.randn(shape, generator=gen).to(dtype)
        self.v = torch.randn(shape, generator=gen).to(dtype)
        self.free = torch.randperm(num_blocks, generator=gen).tolist()

    def take(self, count: int) -> list[int]:
        taken, self.free = self.free[:count], self.free[count:]
        return taken

    def copy(self, table: list[int]) -> list[int]:
        """The same contents in other blocks (as after a swap-in or a recompute)."""
        new = self.take(len(table))
        self.k[new], self.v[new] = self.k[table], self.v[table]
        return new


def tables(rows: list[list[int]]) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32)


def ints(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def prefill(cache: Cache, q: torch.Tensor, chunks: list[tuple[list[int], int, int]], **variant) -> list[torch.Tensor]:
    """One prefill call over chunks (block table, first position, query count); q [seq, H, D] per
    position. Returns each chunk's output rows. `variant`: sliding_window, logits_soft_cap."""
    query = torch.cat([q[start : start + count] for _, start, count in chunks])
    starts = [0]
    for _, _, count in chunks:
        starts.append(starts[-1] + count)
    on = cache.k.device
    out = ops.paged_attention_prefill(query, cache.k, cache.v, tables([t for t, _, _ in chunks]).to(on),
                                      ints([s + c for _, s, c in chunks]).to(on), ints(starts).to(on), 0.125,
                                      **variant)
    return [out[starts[i] : starts[i + 1]] for i in range(len(chunks))]


def decode(cache: Cache, q: torch.Tensor, seqs: list[tuple[list[int], int]], groups: list[int] | None = None,
           **variant) -> torch.Tensor:
    """One decode call: per sequence (block table, position), q [seq, H, D] per position."""
    query = torch.stack([q[pos] for _, pos in seqs])
    on = cache.k.device
    return ops.paged_attention_decode(query, cache.k, cache.v, tables([t for t, _ in seqs]).to(on),
                                      ints([p + 1 for _, p in seqs]).to(on), 0.125,
                                      seq_groups=None if groups is None else ints(groups), **variant)


def blocks_for(length: int, block_size: int = BLOCK_SIZE) -> int:
    return -(-length // block_size)


def one_sequence(shape, dtype, gen, **variant):
    """A fresh cache holding a SEQ_LEN-token sequence: its block table, another sequence's blocks, the
    queries of every position and the rows of one whole prefill."""
    heads, kv_heads, head_dim = shape
    cache = Cache(kv_heads, head_dim, dtype)
    table = cache.take(blocks_for(SEQ_LEN))
    q = torch.randn(SEQ_LEN, heads, head_dim, generator=gen).to(dtype)
    (whole,) = prefill(cache, q, [(table, 0, SEQ_LEN)], **variant)
    return cache, table, cache.take(blocks_for(SEQ_LEN)), q, whole


@pytest.fixture(params=DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def dtype(request):
    return request.param


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}x{s[2]}")
def test_row_results_do_not_depend_on_the_step(cpu_isas, dtype, shape):
    from batchgen import _C

    gen = torch.Generator().manual_seed(2)
    for isa in cpu_isas:
        _C.set_cpu_isa(isa)
        cache, table, other, q, whole = one_sequence(shape, dtype, gen)

        def expect(rows: torch.Tensor, first: int, what: str, whole=whole, isa=isa) -> None:
            want = whole[first : first + len(rows)]
            assert torch.equal(rows, want), (
                f"{isa}, {dtype}: {what}: rows {first}..{first + len(rows) - 1} differ from one whole prefill "
                f"(max |diff| {(rows.float() - want.float()).abs().max().item():.3g})")

        # Chunked prefill: cuts at block and tile boundaries and between them, alone and beside others.
        for cuts in ([100], [16, 64, 200], [1, 2, 3, 130, 299], [63, 65, 127, 191, 257]):
            bounds = [0, *cuts, SEQ_LEN]
            for a, b in zip(bounds, bounds[1:], strict=False):
                (rows,) = prefill(cache, q, [(table, a, b - a)])
                expect(rows, a, f"a chunk {a}..{b}")
                rows = prefill(cache, q, [(other, 0, 37), (table, a, b - a), (other, 40, 90)])[1]
                expect(rows, a, f"a chunk {a}..{b} between other sequences")
        # The same keys in other blocks (a swap-in, a recompute, a prefix-cache hit).
        (rows,) = prefill(cache, q, [(cache.copy(table), 150, 150)])
        expect(rows, 150, "keys in other blocks")
        # Decode of every position, alone, in small and large batches, on one or two threads.
        positions = [0, 15, 16, 63, 64, 65, 200, 299]
        for pos in positions:
            expect(decode(cache, q, [(table, pos)]), pos, f"a decode at {pos} alone")
        for threads in (1, 2):
            with torch_threads(threads):
                batch = [(table, p) for p in positions] + [(other, p) for p in range(0, SEQ_LEN, 7)]
                out = decode(cache, q, batch)
                for i, pos in enumerate(positions):
                    expect(out[i : i + 1], pos, f"a decode at {pos} in a batch of {len(batch)}, {threads} threads")
                (rows,) = prefill(cache, q, [(table, 0, SEQ_LEN)])
                expect(rows, 0, f"a whole prefill on {threads} threads")


@pytest.mark.parametrize("block_size", [8, 32])
@pytest.mark.parametrize("shape", [(4, 1, 64), (8, 2, 80)], ids=lambda s: f"{s[0]}x{s[1]}x{s[2]}")
def test_rows_at_other_block_sizes_do_not_depend_on_the_step(cpu_isas, dtype, shape, block_size):
    """Blocks of 8 keys (half a 16-key score tile on the amx_bf16 table) and of 32 (two), with head dims
    of whole and half 32-element steps: a row decoded alone, or prefilled as the only token of its
    chunk, equals the same row among the 15 others of its 16-row group in one whole prefill."""
    from batchgen import _C

    heads, kv_heads, head_dim = shape
    gen = torch.Generator().manual_seed(5)
    checked = 0
    for isa in cpu_isas:
        _C.set_cpu_isa(isa)
        cache = Cache(kv_heads, head_dim, dtype, num_blocks=200, block_size=block_size)
        table = cache.take(blocks_for(SEQ_LEN, block_size))
        q = torch.randn(SEQ_LEN, heads, head_dim, generator=gen).to(dtype)
        (whole,) = prefill(cache, q, [(table, 0, SEQ_LEN)])
        positions = [0, 7, 8, 15, 31, 32, 63, 64, 100, 191, 299]
        out = decode(cache, q, [(table, p) for p in positions])
        for i, pos in enumerate(positions):
            assert torch.equal(out[i], whole[pos]), f"{isa}, {dtype}, block {block_size}: a decode at {pos}"
            (rows,) = prefill(cache, q, [(table, pos, 1)])
            assert torch.equal(rows[0], whole[pos]), f"{isa}, {dtype}, block {block_size}: a 1-token chunk at {pos}"
            checked += 1
        for a, b in [(0, 9), (9, 70), (70, 255), (255, SEQ_LEN)]:
            (rows,) = prefill(cache, q, [(table, a, b - a)])
            assert torch.equal(rows, whole[a:b]), f"{isa}, {dtype}, block {block_size}: a chunk {a}..{b}"
    assert checked == len(positions) * len(cpu_isas)


@pytest.mark.parametrize("shared_len", [70, 130, 256])
def test_samples_sharing_blocks_decode_as_if_alone(cpu_isas, dtype, shared_len):
    """Samples of one prompt (seq_groups) read the shared blocks once for all of them; each sample's
    rows still equal its own prefill's."""
    from batchgen import _C

    heads, kv_heads, head_dim = SHAPES[0]
    gen = torch.Generator().manual_seed(3)
    for isa in cpu_isas:
        _C.set_cpu_isa(isa)
        cache = Cache(kv_heads, head_dim, dtype)
        prompt = cache.take(shared_len // BLOCK_SIZE)  # whole blocks in common
        members = []
        for j in range(6):
            length = shared_len + 5 + 23 * j
            members.append((prompt + cache.take(blocks_for(length) - len(prompt)), length - 1))
        q = torch.randn(SEQ_LEN + 200, heads, head_dim, generator=gen).to(dtype)
        for threads in (1, 2):
            with torch_threads(threads):
                out = decode(cache, q, members, groups=[7] * len(members))
            for j, (table, pos) in enumerate(members):
                (whole,) = prefill(cache, q, [(table, 0, pos + 1)])
                assert torch.equal(out[j], whole[pos]), (
                    f"{isa}, {dtype}, {threads} threads: sample {j} of a group sharing {shared_len} keys differs "
                    f"from its own prefill")


# Mistral's window (not on a block or tile boundary) with Gemma 2's soft cap.
VARIANT = dict(sliding_window=90, logits_soft_cap=5.0)


def test_windowed_rows_do_not_depend_on_the_step(cpu_isas, dtype):
    """With a sliding window a row walks only the tiles of its window, starting wherever its task's
    first row's window does; chunks, decodes, batches and shared samples still give the same bits."""
    from batchgen import _C

    heads, _, head_dim = SHAPES[1]
    gen = torch.Generator().manual_seed(4)
    for isa in cpu_isas:
        _C.set_cpu_isa(isa)
        cache, table, other, q, whole = one_sequence(SHAPES[1], dtype, gen, **VARIANT)

        def expect(rows: torch.Tensor, first: int, what: str, whole=whole, isa=isa) -> None:
            assert torch.equal(rows, whole[first : first + len(rows)]), f"{isa}, {dtype}: {what}"

        for a, b in [(0, 63), (63, 65), (65, 200), (200, SEQ_LEN), (91, 92)]:
            (rows,) = prefill(cache, q, [(table, a, b - a)], **VARIANT)
            expect(rows, a, f"a chunk {a}..{b}")
            rows = prefill(cache, q, [(other, 0, 37), (table, a, b - a)], **VARIANT)[1]
            expect(rows, a, f"a chunk {a}..{b} beside another sequence")
        positions = [0, 89, 90, 91, 153, 154, 299]
        for threads in (1, 2):
            with torch_threads(threads):
                out = decode(cache, q, [(table, p) for p in positions] + [(other, 150)], **VARIANT)
            for i, pos in enumerate(positions):
                expect(out[i : i + 1], pos, f"a decode at {pos} in a batch, {threads} threads")
        # Samples sharing 256 keys, their windows starting before, inside and after the shared blocks.
        prompt = table[:16]
        members = [(prompt + cache.take(blocks_for(length) - 16), length - 1) for length in (260, 300, 340, 400)]
        q_long = torch.randn(400, heads, head_dim, generator=gen).to(dtype)
        out = decode(cache, q_long, members, groups=[3] * len(members), **VARIANT)
        for j, (member_table, pos) in enumerate(members):
            (rows,) = prefill(cache, q_long, [(member_table, pos, 1)], **VARIANT)
            assert torch.equal(out[j], rows[0]), f"{isa}, {dtype}: sample {j} of a group"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("variant", [{}, VARIANT], ids=["plain", "window+cap"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}x{s[2]}")
def test_cuda_rows_do_not_depend_on_the_step(dtype, shape, variant):
    """On CUDA: a decode row alone equals the same row among others, beside contexts long enough to
    change the launch's grid and workspace (its splits are a fixed number of keys); a prefill row equals
    the same row however the prompt was chunked and whatever shares the call. Decode and prefill are
    different kernels there (tensor cores in prefill): their rows are compared only with their own kind's."""
    heads, kv_heads, head_dim = shape
    gen = torch.Generator().manual_seed(6)
    cache = Cache(kv_heads, head_dim, dtype, num_blocks=700)
    cache.k, cache.v = cache.k.cuda(), cache.v.cuda()
    table, other = cache.take(blocks_for(SEQ_LEN)), cache.take(blocks_for(1500))
    q = torch.randn(1500, heads, head_dim, generator=gen).to(dtype).cuda()
    (whole,) = prefill(cache, q, [(table, 0, SEQ_LEN)], **variant)
    for cuts in ([100], [1, 2, 3, 130, 299], [63, 65, 127, 191, 257]):
        bounds = [0, *cuts, SEQ_LEN]
        for a, b in zip(bounds, bounds[1:], strict=False):
            for rows in (prefill(cache, q, [(table, a, b - a)], **variant)[0],
                         prefill(cache, q, [(other, 0, 700), (table, a, b - a)], **variant)[1]):
                assert torch.equal(rows, whole[a:b]), f"{dtype}: prefill rows {a}..{b - 1} depend on the step"
    positions = [0, 15, 16, 63, 255, 256, 257, 299]
    alone = torch.cat([decode(cache, q, [(table, p)], **variant) for p in positions])
    for neighbours in ([(other, 1499)], [(other, p) for p in range(0, 1500, 97)]):
        out = decode(cache, q, [(table, p) for p in positions] + neighbours, **variant)
        for i, pos in enumerate(positions):
            assert torch.equal(out[i], alone[i]), f"{dtype}: a decode at {pos} depends on its neighbours"
