"""BlockManager: which physical KV blocks each sequence holds, on the device and in the CPU pool.

Blocks are reference-counted: forked samples share their parent's blocks, and with prefix caching,
full blocks are shared across requests by content. A full block's key is a hash of its parent
block's key and its own content: its token ids, and the content hashes of the images whose tokens it
holds (block_content; a first block's parent: its LoRA adapter, see prefix_root); a lookup verifies the
stored content and parent key, so a hash collision can never hand out wrong
K/V. A cached block whose last holder lets go stays findable ("evictable") until its slot is needed:
fresh allocations take never-cached free blocks first, then evict the least recently freed cached
block. Sequences free their blocks last block first, so a prefix outlives its tails. Never-cached
blocks are handed out last freed first, lowest id first among those never used: the host KV cache
takes memory as its pages are first written, so reusing written blocks keeps RSS at the blocks a run
has needed rather than the whole pool.

The manager only decides; it returns (src, dst) block pairs for the model runner to copy or
swap. All operations cost O(blocks touched), never O(pool).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from batchgen.engine.sequence import Sequence


@dataclass(slots=True)
class Block:
    ref_count: int = 0
    num_filled: int = 0  # leading slots whose K/V has been computed
    hash: int | None = None  # set once the block is full and registered for prefix caching
    parent_hash: int | None = None
    token_ids: tuple | None = None  # its content (block_content)


@dataclass(kw_only=True)
class BlockStats:
    num_device_blocks: int
    used_device_blocks: int
    free_device_blocks: int  # allocatable now, cached ones included
    cached_device_blocks: int  # free but still findable by the prefix cache
    peak_used_device_blocks: int
    num_cpu_blocks: int
    used_cpu_blocks: int
    filled_slots: int  # computed tokens held in used device blocks, each block counted once
    allocated_slots: int  # used_device_blocks * block_size
    prefix_cache_query_tokens: int
    prefix_cache_hit_tokens: int
    blocks_swapped_out: int
    blocks_swapped_in: int
    blocks_copied: int

    @property
    def slot_utilization(self) -> float:
        """Fraction of the slots of the blocks in use now that hold computed K/V (1.0 if none)."""
        return self.filled_slots / self.allocated_slots if self.allocated_slots else 1.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hit_tokens / max(1, self.prefix_cache_query_tokens)


def block_key(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((parent_hash, token_ids))


def block_content(seq: Sequence, index: int, block_size: int) -> tuple:
    """What block `index` of seq's K/V depends on besides its parent: its token ids, and with images the content
    hashes of those whose tokens fall in it (two images give their tokens the same ids)."""
    start, end = index * block_size, (index + 1) * block_size
    tokens = tuple(seq.token_ids[start:end])
    if seq.multi_modal is None:
        return tokens
    images = seq.multi_modal.block_extra_key(start, end)
    return (*tokens, ("images", images)) if images else tokens


def prefix_root(seq: Sequence) -> int | None:
    """The parent key of a sequence's first block: what its K/V depends on besides the tokens. Under a LoRA
    adapter the same tokens give other K/V, so each adapter's blocks form a cache of their own."""
    return block_key(None, ("lora", seq.lora_id)) if seq.lora_id else None


class _Blocks(dict[int, Block]):
    """Block records by id, each made when first looked up, so that a pool's records cost nothing
    until its blocks are used: making them all at start took ~0.2-0.3 s for the 2 x 131,072 blocks
    of a tiny model's default 4 GiB cache and swap space."""

    def __missing__(self, block_id: int) -> Block:
        block = self[block_id] = Block()
        return block


@dataclass
class _Pool:
    """Plain reference-counted pool (the CPU swap space): no caching, LIFO free list."""

    size: int
    blocks: _Blocks = field(default_factory=_Blocks)
    free: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.free = list(reversed(range(self.size)))

    def allocate(self) -> int:
        block_id = self.free.pop()
        self.blocks[block_id].ref_count = 1
        return block_id

    def decref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.blocks[block_id] = Block()
            self.free.append(block_id)


class BlockManager:
    def __init__(self, num_device_blocks: int, num_cpu_blocks: int, block_size: int,
                 enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.num_device_blocks = num_device_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self._device = _Blocks()
        self._never_cached: list[int] = list(reversed(range(num_device_blocks)))  # a stack: pop() is next
        self._evictable: OrderedDict[int, None] = OrderedDict()  # least recently freed first
        self._by_hash: dict[int, int] = {}
        self._cpu = _Pool(num_cpu_blocks)
        self._on_cpu: set[int] = set()  # seq ids whose block table holds CPU ids
        self._filled_slots = 0
        self._peak_used = 0
        self._query_tokens = self._hit_tokens = 0
        self._swapped_out = self._swapped_in = self._copied = 0

    # --- sizes ------------------------------------------------------------------------------
    @property
    def num_free_device_blocks(self) -> int:
        return len(self._never_cached) + len(self._evictable)

    @property
    def num_used_device_blocks(self) -> int:
        return self.num_device_blocks - self.num_free_device_blocks

    @property
    def num_free_cpu_blocks(self) -> int:
        return len(self._cpu.free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # --- device pool primitives -------------------------------------------------------------
    def _incref(self, block_id: int) -> None:
        block = self._device[block_id]
        if block.ref_count == 0:
            self._evictable.pop(block_id)  # only cached blocks are taken back from the free pool
            self._filled_slots += block.num_filled
            self._peak_used = max(self._peak_used, self.num_used_device_blocks)
        block.ref_count += 1

    def _decref(self, block_id: int) -> None:
        block = self._device[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self._filled_slots -= block.num_filled
            if block.hash is not None:
                self._evictable[block_id] = None
            else:
                block.num_filled = 0
                self._never_cached.append(block_id)

    def _allocate(self) -> int:
        if self._never_cached:
            block_id = self._never_cached.pop()
        elif self._evictable:
            block_id, _ = self._evictable.popitem(last=False)
            del self._by_hash[self._device[block_id].hash]
            self._device[block_id] = Block()
        else:
            raise RuntimeError("no free device KV block: the scheduler must check before allocating")
        self._device[block_id].ref_count = 1
        self._peak_used = max(self._peak_used, self.num_used_device_blocks)
        return block_id

    def _set_filled(self, block_id: int, num_filled: int) -> None:
        block = self._device[block_id]
        self._filled_slots += num_filled - block.num_filled
        block.num_filled = num_filled

    # --- prefix caching ---------------------------------------------------------------------
    def _hashes(self, seq: Sequence, num_blocks: int) -> list[int]:
        """Content keys of seq's first num_blocks full blocks, extending seq.block_hashes."""
        bs, hashes = self.block_size, seq.block_hashes
        while len(hashes) < num_blocks:
            i = len(hashes)
            hashes.append(block_key(hashes[-1] if i else prefix_root(seq), block_content(seq, i, bs)))
        return hashes

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Device blocks holding seq's longest cached prefix; at least its last token stays to compute,
        and so does every position from seq.keep_hidden_from on (its hidden states are wanted)."""
        if not self.enable_prefix_caching:
            return []
        bs, max_blocks = self.block_size, self._cacheable_blocks(seq)
        hits: list[int] = []
        parent = prefix_root(seq)
        for i, key in enumerate(self._hashes(seq, max_blocks)[:max_blocks]):
            block_id = self._by_hash.get(key)
            if block_id is None:
                break
            block = self._device[block_id]
            if block.parent_hash != parent or block.token_ids != block_content(seq, i, bs):
                break  # a hash collision: the stored block holds other tokens
            hits.append(block_id)
            parent = key
        return hits

    def _cacheable_blocks(self, seq: Sequence) -> int:
        """How many of seq's first blocks may come from the cache: full, before its last token (which is
        computed) and before the positions whose hidden states are wanted."""
        max_blocks = (len(seq.token_ids) - 1) // self.block_size
        if seq.keep_hidden_from is not None:
            max_blocks = min(max_blocks, seq.keep_hidden_from // self.block_size)
        return max_blocks

    def first_block_key(self, seq: Sequence) -> int | None:
        """The prefix cache's key of seq's first block when that block could be a hit, else None."""
        if not self.enable_prefix_caching or self._cacheable_blocks(seq) < 1:
            return None
        return self._hashes(seq, 1)[0]

    def is_cached(self, key: int) -> bool:
        return key in self._by_hash

    def _register(self, seq: Sequence, index: int, block_id: int) -> None:
        block = self._device[block_id]
        hashes = self._hashes(seq, index + 1)
        if block.hash is not None or hashes[index] in self._by_hash:
            return  # already registered, or the same content sits in another block
        bs, key = self.block_size, hashes[index]
        block.hash, block.parent_hash = key, hashes[index - 1] if index else prefix_root(seq)
        block.token_ids = block_content(seq, index, bs)
        self._by_hash[key] = block_id

    # --- sequences --------------------------------------------------------------------------
    def num_blocks_to_allocate(self, seqs: list[Sequence]) -> int:
        """Free blocks that allocating all seqs takes: new ones, plus cached hits that sit in the
        free pool (counted once even when several seqs hit them)."""
        new, idle_hits = 0, set()
        for seq in seqs:
            hits = self._cached_prefix(seq)
            new += self.blocks_for(len(seq)) - len(hits)
            idle_hits.update(b for b in hits if self._device[b].ref_count == 0)
        return new + len(idle_hits)

    def allocate(self, seq: Sequence) -> None:
        """Blocks for all of seq's tokens, reusing its longest cached prefix; sets num_computed_tokens."""
        assert not seq.block_table, f"sequence {seq.seq_id} already holds blocks"
        hits = self._cached_prefix(seq)
        for block_id in hits:
            self._incref(block_id)
        fresh = [self._allocate() for _ in range(self.blocks_for(len(seq)) - len(hits))]
        seq.block_table = hits + fresh
        seq.num_computed_tokens = len(hits) * self.block_size
        if self.enable_prefix_caching:
            self._query_tokens += len(seq)
            self._hit_tokens += seq.num_computed_tokens

    def fork(self, parent: Sequence, child: Sequence) -> None:
        for block_id in parent.block_table:
            self._incref(block_id)
        child.block_table = list(parent.block_table)

    def free(self, seq: Sequence) -> None:
        release = self._cpu.decref if seq.seq_id in self._on_cpu else self._decref
        for block_id in reversed(seq.block_table):
            release(block_id)
        seq.block_table = []
        self._on_cpu.discard(seq.seq_id)

    # --- writes -----------------------------------------------------------------------------
    def num_blocks_to_write(self, writes: list[tuple[Sequence, int, int]]) -> int:
        """Free device blocks that writing positions [start, end) of each seq takes: blocks
        past the end of its table, plus copies of shared blocks (when all holders of a block
        write it, the last writer keeps the original). Works for CPU tables too (swap-in)."""
        bs, new = self.block_size, 0
        if len(writes) == 1 and writes[0][2] - writes[0][1] == 1:  # one decode: a new block, or a copy if shared
            seq, start, _ = writes[0]
            table, i = seq.block_table, start // bs
            if i >= len(table):
                return 1
            pool = self._cpu.blocks if seq.seq_id in self._on_cpu else self._device
            return int(pool[table[i]].ref_count > 1)
        writers: dict[tuple[bool, int], int] = {}
        for seq, start, end in writes:
            on_cpu = seq.seq_id in self._on_cpu
            for i in range(start // bs, (end - 1) // bs + 1):
                if i >= len(seq.block_table):
                    new += 1
                else:
                    key = (on_cpu, seq.block_table[i])
                    writers[key] = writers.get(key, 0) + 1
        copies = 0
        for (on_cpu, block_id), count in writers.items():
            copies += count if self.ref_count(block_id, on_cpu) > count else count - 1
        return new + copies

    def decode_writes(self, seqs: list[Sequence]) -> list[Sequence] | None:
        """For decoding each device sequence's last token, in one pass: those whose write takes a call to
        prepare_write (their table is full: one new block each, as decoding goes), in order; the others write
        into a block they hold alone. None where a sequence's last block is shared, whose copies depend on which
        of its holders write (num_blocks_to_write counts them)."""
        bs, device, writes = self.block_size, self._device, []
        for seq in seqs:
            table, i = seq.block_table, (len(seq.token_ids) - 1) // bs
            if i >= len(table):
                writes.append(seq)
                continue
            block = device[table[i]]
            if block.ref_count > 1:
                return None
            if block.hash is not None:  # never for a decode; prepare_write says so
                writes.append(seq)
        return writes

    def prepare_write(self, seq: Sequence, start: int, end: int) -> list[tuple[int, int]]:
        """Makes seq's blocks for positions [start, end) exist and be its own: appends a block
        when the last is full, copies a shared block first (copy-on-write). Returns (src, dst)
        copies for the runner."""
        bs, table, copies = self.block_size, seq.block_table, []
        if end - start == 1 and start // bs < len(table):  # a decode into a block it holds alone: nothing to do
            block = self._device[table[start // bs]]
            if block.ref_count == 1 and block.hash is None:
                return copies
        for i in range(start // bs, (end - 1) // bs + 1):
            if i == len(table):
                table.append(self._allocate())
                continue
            block_id = table[i]
            block = self._device[block_id]
            assert block.hash is None, f"write into registered full block {block_id}"
            if block.ref_count > 1:
                new_id = self._allocate()
                self._set_filled(new_id, block.num_filled)
                self._decref(block_id)
                # A new list: a table list changes in place only by appends (engine/block_tables.py relies on it).
                table = seq.block_table = [*table[:i], new_id, *table[i + 1:]]
                copies.append((block_id, new_id))
        self._copied += len(copies)
        return copies

    def mark_decoded(self, seqs: list[Sequence]) -> None:
        """mark_computed of each sequence's one newest position, in order (the step's decodes, which have just
        set num_computed_tokens past it), in one call."""
        bs, device, caching, filled_slots = self.block_size, self._device, self.enable_prefix_caching, 0
        for seq in seqs:
            end = seq.num_computed_tokens
            i = (end - 1) // bs
            filled = end - i * bs
            block = device[seq.block_table[i]]
            filled_slots += filled - block.num_filled
            block.num_filled = filled
            if filled == bs and caching:
                self._register(seq, i, seq.block_table[i])
        self._filled_slots += filled_slots

    def mark_computed(self, seq: Sequence, start: int, end: int) -> None:
        """Positions [start, end) of seq now hold K/V: count them, register blocks that got full."""
        bs = self.block_size
        if end - start == 1:  # a decode: one position in one block
            i = start // bs
            filled = end - i * bs
            self._set_filled(seq.block_table[i], filled)
            if filled == bs and self.enable_prefix_caching:
                self._register(seq, i, seq.block_table[i])
            return
        for i in range(start // bs, (end - 1) // bs + 1):
            block_id = seq.block_table[i]
            filled = min(bs, end - i * bs)
            self._set_filled(block_id, filled)
            if filled == bs and self.enable_prefix_caching:
                self._register(seq, i, block_id)

    # --- swapping ---------------------------------------------------------------------------
    def num_blocks_to_swap(self, seqs: list[Sequence]) -> int:
        """Distinct blocks in the seqs' tables: a block shared by several samples moves once."""
        return len({block_id for seq in seqs for block_id in seq.block_table})

    def swap_out(self, seqs: list[Sequence]) -> list[tuple[int, int]]:
        """Moves the seqs' tables to the CPU pool; returns (device id, cpu id) pairs to copy."""
        mapping: dict[int, int] = {}
        for seq in seqs:
            table = []
            for block_id in seq.block_table:
                cpu_id = mapping.get(block_id)
                if cpu_id is None:
                    cpu_id = mapping[block_id] = self._cpu.allocate()
                    src, dst = self._device[block_id], self._cpu.blocks[cpu_id]
                    dst.num_filled, dst.hash, dst.parent_hash, dst.token_ids = (
                        src.num_filled, src.hash, src.parent_hash, src.token_ids)
                else:
                    self._cpu.blocks[cpu_id].ref_count += 1
                table.append(cpu_id)
            self.free(seq)  # device blocks; cached ones stay findable
            seq.block_table = table
            self._on_cpu.add(seq.seq_id)
        self._swapped_out += len(mapping)
        return list(mapping.items())

    def swap_in(self, seqs: list[Sequence]) -> list[tuple[int, int]]:
        """Moves the seqs' tables back to the device; returns (cpu id, device id) pairs to copy.
        A full block whose content is still cached on the device is reused instead of copied."""
        mapping: dict[int, int] = {}
        moves = []
        for seq in seqs:
            table = []
            for cpu_id in seq.block_table:
                block_id = mapping.get(cpu_id)
                if block_id is not None:
                    self._incref(block_id)
                else:
                    block_id = mapping[cpu_id] = self._device_copy_of(cpu_id, moves)
                table.append(block_id)
            self.free(seq)  # CPU blocks
            seq.block_table = table
        self._swapped_in += len(moves)
        return moves

    def _device_copy_of(self, cpu_id: int, moves: list[tuple[int, int]]) -> int:
        src = self._cpu.blocks[cpu_id]
        cached = self._by_hash.get(src.hash) if src.hash is not None else None
        if cached is not None and self._device[cached].token_ids == src.token_ids \
                and self._device[cached].parent_hash == src.parent_hash:
            self._incref(cached)
            return cached
        block_id = self._allocate()
        self._set_filled(block_id, src.num_filled)
        dst = self._device[block_id]
        if src.hash is not None and src.hash not in self._by_hash:
            dst.hash, dst.parent_hash, dst.token_ids = src.hash, src.parent_hash, src.token_ids
            self._by_hash[src.hash] = block_id
        moves.append((cpu_id, block_id))
        return block_id

    # --- reporting --------------------------------------------------------------------------
    def ref_count(self, block_id: int, on_cpu: bool = False) -> int:
        return (self._cpu.blocks if on_cpu else self._device)[block_id].ref_count

    def free_block_ids(self, on_cpu: bool = False) -> list[int]:
        """All free block ids (O(pool): for tests and debugging)."""
        if on_cpu:
            return list(self._cpu.free)
        return self._never_cached[::-1] + list(self._evictable)

    def stats(self) -> BlockStats:
        used = self.num_used_device_blocks
        return BlockStats(
            num_device_blocks=self.num_device_blocks, used_device_blocks=used,
            free_device_blocks=self.num_free_device_blocks, cached_device_blocks=len(self._evictable),
            peak_used_device_blocks=self._peak_used, num_cpu_blocks=self._cpu.size,
            used_cpu_blocks=self._cpu.size - len(self._cpu.free),
            filled_slots=self._filled_slots, allocated_slots=used * self.block_size,
            prefix_cache_query_tokens=self._query_tokens, prefix_cache_hit_tokens=self._hit_tokens,
            blocks_swapped_out=self._swapped_out, blocks_swapped_in=self._swapped_in,
            blocks_copied=self._copied,
        )
