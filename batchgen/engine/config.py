"""SchedulerConfig: the sizes and policies the scheduler and block manager work with."""

from __future__ import annotations

from dataclasses import dataclass

PREEMPTION_MODES = ("swap", "recompute")


def batch_limits_problem(max_num_seqs: int, max_num_batched_tokens: int) -> str | None:
    """Every running sequence decodes one token in every step, so a step's token budget must
    hold one token for each of them."""
    if max_num_batched_tokens >= max_num_seqs:
        return None
    return f"must be >= max_num_seqs ({max_num_seqs}) so every running sequence can decode"


def samples_problem(n: int, max_num_seqs: int) -> str | None:
    """The n samples (or beams) of a request run together, so they must fit in max_num_seqs."""
    if n <= max_num_seqs:
        return None
    return f"{n} samples or beams of one request run together and need max_num_seqs >= {n} (it is {max_num_seqs})"


@dataclass(kw_only=True)
class SchedulerConfig:
    """Sizes are in tokens or KV-cache blocks of `block_size` tokens.

    max_num_seqs caps the sequences resident on the device (a request with n samples counts n
    from admission on), so every running sequence can decode in every step (see
    batch_limits_problem). Prompts longer than the token budget are prefilled in chunks.
    max_model_len None means only the device pool bounds a prompt.
    watermark is the fraction of device blocks an admission or swap-in must leave free while
    other requests run, so that admitting work does not at once force a preemption.
    """

    num_device_blocks: int
    num_cpu_blocks: int = 0
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    preemption_mode: str = "swap"
    watermark: float = 0.01
    max_loras: int = 0  # device slots for LoRA adapters; 0: no adapters

    def __post_init__(self) -> None:
        limits = batch_limits_problem(self.max_num_seqs, self.max_num_batched_tokens)
        checks = [
            (self.block_size >= 1, "block_size", "must be >= 1"),
            (self.num_device_blocks >= 1, "num_device_blocks", "must be >= 1"),
            (self.num_cpu_blocks >= 0, "num_cpu_blocks", "must be >= 0"),
            (self.max_num_seqs >= 1, "max_num_seqs", "must be >= 1"),
            (limits is None, "max_num_batched_tokens", limits),
            (self.max_model_len is None or self.max_model_len >= 1, "max_model_len", "must be >= 1 or None"),
            (self.preemption_mode in PREEMPTION_MODES, "preemption_mode", "must be 'swap' or 'recompute'"),
            (0 <= self.watermark < 1, "watermark", "must be in [0, 1)"),
            (self.max_loras >= 0, "max_loras", "must be >= 0"),
        ]
        for ok, name, why in checks:
            if not ok:
                raise ValueError(f"SchedulerConfig.{name}: {why} (got {getattr(self, name)!r})")

    @property
    def watermark_blocks(self) -> int:
        return int(self.watermark * self.num_device_blocks)
