"""Engine options as users give them (vLLM's names), checked once, with byte sizes parsed."""

from __future__ import annotations

import re
from dataclasses import dataclass

from batchgen.engine.config import batch_limits_problem

MODEL_IMPLS = ("auto", "native", "transformers")
QUANTIZATIONS = ("int8",)
# The KV cache's element type: auto (the model's dtype) or fp8 (vLLM's names; "fp8" is e4m3, as in vLLM).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "tb": 10**12}


def parse_bytes(value: int | str, name: str) -> int:
    """4096, "4GiB", "512 MB" -> bytes."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(value))
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        raise ValueError(f"{name}: {value!r} is not a size (use bytes or a unit, e.g. '4GiB', '512MB')")
    return int(float(match.group(1)) * _UNITS[unit])


@dataclass(frozen=True)
class ConfigProblem:
    """An engine option that cannot work; ``option`` is "model" for the model itself."""

    option: str
    message: str

    def __str__(self) -> str:
        return f"{self.option}: {self.message}"


class ConfigError(ValueError):
    """Engine options that cannot work, every one of them in ``problems``."""

    def __init__(self, problems: list[ConfigProblem]):
        self.problems = problems
        super().__init__("; ".join(map(str, problems)))


@dataclass
class EngineConfig:
    model: str
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    kv_cache_memory: int | str = "4GiB"
    gpu_memory_utilization: float = 0.9
    swap_space: int | str = "4GiB"
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    preemption_mode: str = "swap"
    seed: int = 0
    num_threads: int | None = None
    skip_tokenizer_init: bool = False  # token ids in, token ids out: no tokenizer is loaded
    model_impl: str = "auto"  # native | transformers | auto: native where batchgen has one
    served_model_name: str | None = None  # the model's name in outputs (default: `model` as given)
    enable_lora: bool = False  # requests may name LoRA adapters (docs/lora.md)
    max_loras: int = 1  # adapters resident at once (device slots); others wait in host memory
    max_lora_rank: int = 16  # the largest adapter rank accepted
    max_cpu_loras: int | None = None  # adapters kept in host memory (None: all); the least recently used go
    quantization: str | None = None  # "int8": the layers' projections on int8 compute (docs/int8.md)
    enforce_eager: bool = False  # CUDA: decode steps launched op by op instead of replayed as CUDA graphs
    kv_cache_dtype: str = "auto"  # fp8 | fp8_e4m3 | fp8_e5m2: half the bytes per cached token (docs/kv-cache.md)
    num_gpu_blocks_override: int | None = None  # the KV cache's blocks on any device, whatever the memory options say

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise ConfigError(problems)

    @property
    def kv_cache_bytes(self) -> int:
        return parse_bytes(self.kv_cache_memory, "kv_cache_memory")

    @property
    def swap_bytes(self) -> int:
        return parse_bytes(self.swap_space, "swap_space")

    def problems(self) -> list[ConfigProblem]:
        """Every option that is wrong on its own or with the others (the model is not looked at)."""
        problems = []
        limits = batch_limits_problem(self.max_num_seqs, self.max_num_batched_tokens)
        for name in ("kv_cache_memory", "swap_space"):
            try:
                parse_bytes(getattr(self, name), name)
            except ValueError as e:
                problems.append(ConfigProblem(name, str(e).split(": ", 1)[1]))
        checks = [
            (self.dtype in ("auto", "float32", "bfloat16", "float16"), "dtype",
             "must be auto, float32, bfloat16 or float16"),
            (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:"), "device",
             "must be auto, cpu or cuda"),
            (self.block_size in (8, 16, 32), "block_size", "must be 8, 16 or 32"),
            (0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization", "must be in (0, 1]"),
            (self.max_num_seqs >= 1, "max_num_seqs", "must be >= 1"),
            (self.max_num_batched_tokens >= 1, "max_num_batched_tokens", "must be >= 1"),
            (self.max_model_len is None or self.max_model_len >= 1, "max_model_len", "must be >= 1"),
            (self.preemption_mode in ("swap", "recompute"), "preemption_mode", "must be swap or recompute"),
            (self.num_threads is None or self.num_threads >= 1, "num_threads", "must be >= 1"),
            (self.model_impl in MODEL_IMPLS, "model_impl", "must be auto, native or transformers"),
            (self.max_loras >= 1, "max_loras", "must be >= 1"),
            (self.max_lora_rank >= 1, "max_lora_rank", "must be >= 1"),
            (self.max_cpu_loras is None or self.max_cpu_loras >= self.max_loras, "max_cpu_loras",
             f"must be >= max_loras ({self.max_loras}): the resident adapters stay in host memory"),
            (self.quantization in (None, *QUANTIZATIONS), "quantization", "must be int8 or unset"),
            (self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype", "must be auto, fp8, fp8_e4m3 or fp8_e5m2"),
            (self.num_gpu_blocks_override is None or self.num_gpu_blocks_override >= 2, "num_gpu_blocks_override",
             "must be >= 2"),
            (limits is None, "max_num_batched_tokens", limits),
        ]
        problems += [ConfigProblem(name, f"{why} (got {getattr(self, name)!r})") for ok, name, why in checks if not ok]
        return problems


# vLLM's engine arguments that change nothing batchgen computes or writes (parallelism, logging, compilation,
# where downloads go): `LLM(...)` accepts them, with one warning naming them, so that code written for vLLM
# runs as it is.
VLLM_NO_OPS = frozenset({
    "tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size", "distributed_executor_backend",
    "disable_custom_all_reduce", "trust_remote_code", "tokenizer_mode", "disable_log_stats", "enable_chunked_prefill",
    "max_seq_len_to_capture", "compilation_config", "download_dir", "disable_async_output_proc", "use_tqdm_on_load",
    "max_logprobs", "enable_sleep_mode", "cpu_offload_gb", "hf_token", "max_parallel_loading_workers",
})
# vLLM arguments that are no-ops at these values only; any other value would change the output, so it is refused.
VLLM_DEFAULTS = {"load_format": ("auto", "safetensors"), "tokenizer_revision": (None,)}


def engine_config(model: str, options: dict) -> tuple[EngineConfig, list[str]]:
    """`EngineConfig(model, **options)` from options as vLLM's clients pass them: None meaning the default,
    vLLM-only knobs that change no output dropped (their names returned, for a warning), anything else
    unknown or a vLLM knob at a value batchgen cannot honour refused as a ConfigError naming it."""
    import difflib
    from dataclasses import fields

    known = {f.name for f in fields(EngineConfig)} - {"model"}
    kept, ignored, problems = {}, [], []
    for name, value in options.items():
        if name == "tokenizer" and value not in (None, model):
            problems.append(ConfigProblem(name, "batchgen uses the model directory's own tokenizer; leave it unset"))
        elif name in VLLM_DEFAULTS and value not in (*VLLM_DEFAULTS[name], None):
            allowed = " or ".join(repr(v) for v in VLLM_DEFAULTS[name])
            problems.append(ConfigProblem(name, f"batchgen supports only {allowed} (got {value!r})"))
        elif value is None or name in ("tokenizer", *VLLM_DEFAULTS):
            continue
        elif name in VLLM_NO_OPS:
            ignored.append(name)
        elif name in known:
            kept[name] = value
        else:
            close = difflib.get_close_matches(name, sorted(known), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            problems.append(ConfigProblem(name, f"not an engine option of batchgen{hint}"))
    if problems:
        raise ConfigError(problems)
    return EngineConfig(model=model, **kept), ignored
