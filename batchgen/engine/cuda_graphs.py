"""CUDA graphs of the model's decode-only steps, one per batch-size bucket (issue 52).

A decode step of a 1-8B model takes a few milliseconds on a GPU, and launching its few hundred kernels one by
one from Python takes about as long. A graph captured once per bucket (1, 2, 4, 8, 16, then steps of 16 up to
`max_num_seqs`) replays them all with one launch. The graph reads its inputs from static buffers: each step's
input ids, positions, slot mapping, block tables and sequence lengths are copied into the first rows of the
buffers, and the rows up to the bucket are padding, whose slot mapping is -1 (their K/V are written nowhere)
and whose other inputs are whatever an earlier step left there (valid positions and block ids: their reads
are in bounds, and their outputs are never read). The block tables are as wide as the longest context the
model allows, so one graph serves every step of its bucket.

Prefill and mixed steps, steps with LoRA adapters and steps that share prompt blocks between samples run
eagerly (`ModelRunner.execute` decides). `LLM(enforce_eager=True)` turns graphs off, as in vLLM.

The capture is a function so that the buffer logic runs without a GPU too: `capture_cuda_graph` records a CUDA
graph, `replay_eagerly` (tests) just calls the forward on the static buffers each time.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from batchgen.errors import first_line
from batchgen.layers.attention import AttentionMetadata

logger = logging.getLogger(__name__)

Replay = Callable[[], torch.Tensor]
Capture = Callable[[Callable[[], torch.Tensor], object], Replay]


def graph_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, 16, then every 16 up to max_num_seqs (which is always the last)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return [*sizes, max_num_seqs]


def capture_cuda_graph(forward: Callable[[], torch.Tensor], pool: object) -> Replay:
    """Runs `forward` once on a side stream (kernels' first calls may allocate or pick algorithms), then
    records it into a CUDA graph drawing on the shared memory `pool`."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        forward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = forward()

    def replay() -> torch.Tensor:
        graph.replay()
        return out

    return replay


def replay_eagerly(forward: Callable[[], torch.Tensor], pool: object) -> Replay:
    """No graph: the forward runs on the static buffers at every replay (the buffer logic, testable on a CPU)."""
    return forward


class DecodeGraphs:
    """Static input buffers and one replayable forward per bucket, captured when first needed."""

    def __init__(self, model: torch.nn.Module, device: torch.device, max_num_seqs: int, max_blocks_per_seq: int,
                 capture: Capture = capture_cuda_graph):
        self.model, self.capture = model, capture
        self.buckets = graph_buckets(max_num_seqs)
        rows = self.buckets[-1]
        self.input_ids = torch.zeros(rows, dtype=torch.int64, device=device)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((rows,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(rows, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(rows, dtype=torch.int32, device=device)
        self.pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        self._replays: dict[int, Replay] = {}
        self.replays = 0  # steps run through a graph (a test asserts the path ran)
        self.failed: str | None = None  # why a capture failed: every step runs eagerly from then on

    def bucket(self, num_seqs: int) -> int | None:
        """The smallest bucket that holds `num_seqs` decodes, or None when none does."""
        return next((b for b in self.buckets if b >= num_seqs), None)

    def fits(self, meta: AttentionMetadata, num_tokens: int) -> bool:
        """A decode-only step that a bucket holds, without samples sharing blocks, tables no wider than ours."""
        return (self.failed is None and meta.num_decode_tokens == num_tokens and meta.decode_seq_groups is None
                and self.bucket(num_tokens) is not None
                and meta.decode_block_tables.shape[1] <= self.block_tables.shape[1])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The model's hidden states for a step that `fits`, from its bucket's graph."""
        n = input_ids.shape[0]
        bucket = self.bucket(n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.slot_mapping[n:bucket].fill_(-1)
        tables = meta.decode_block_tables
        self.block_tables[:n, : tables.shape[1]].copy_(tables)
        self.seq_lens[:n].copy_(meta.decode_seq_lens)
        replay = self._replays.get(bucket)
        if replay is None:
            try:
                replay = self._replays[bucket] = self.capture(self._forward_of(bucket), self.pool)
            except RuntimeError as e:  # an op of this model that a graph cannot hold: eager from now on
                self.failed = first_line(e)
                logger.warning("CUDA graphs off: capturing a decode step failed (%s); steps run eagerly", self.failed)
                return self.model(input_ids, positions, meta)
            logger.debug("captured the decode graph of %d sequences", bucket)
        self.replays += 1
        return replay()[:n]

    def _forward_of(self, bucket: int) -> Callable[[], torch.Tensor]:
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:bucket], num_decode_tokens=bucket,
            decode_block_tables=self.block_tables[:bucket], decode_seq_lens=self.seq_lens[:bucket],
            decode_seq_groups=None, prefill_block_tables=None, prefill_seq_lens=None, prefill_query_start_loc=None)
        ids, positions = self.input_ids[:bucket], self.positions[:bucket]
        return lambda: self.model(ids, positions, meta)
