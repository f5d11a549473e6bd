"""Shared fixtures: tiny random models of each supported architecture, and the real SmolLM2."""

from __future__ import annotations

import pytest
import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TINY_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "paged attention keeps the kv cache in fixed size blocks",
    "a batch of prompts becomes a dataset of completions",
    "hello world, this is batchgen speaking; numbers 0123456789 and symbols !?.,",
] * 20


def _tiny_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TINY_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   unk_token="<|endoftext|>", bos_token="<|im_start|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


ARCHITECTURES = ["llama", "mistral", "qwen2", "qwen3", "llama3_rope"]


def build_tiny_model(path, arch: str, seed: int = 0):
    """A 2-layer random model of `arch` with GQA and head_dim 64, saved with its tokenizer."""
    import transformers as tf

    tokenizer = _tiny_tokenizer()
    common = dict(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024,
        rms_norm_eps=1e-6, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if arch == "llama":
        config, cls = tf.LlamaConfig(**common, tie_word_embeddings=False), tf.LlamaForCausalLM
    elif arch == "llama3_rope":
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
        config = tf.LlamaConfig(**common, tie_word_embeddings=True, rope_parameters=rope)
        cls = tf.LlamaForCausalLM
    elif arch == "mistral":
        config, cls = tf.MistralConfig(**common, sliding_window=None), tf.MistralForCausalLM
    elif arch == "qwen2":
        config, cls = tf.Qwen2Config(**common, tie_word_embeddings=True), tf.Qwen2ForCausalLM
    elif arch == "qwen3":
        config, cls = tf.Qwen3Config(**common, tie_word_embeddings=False), tf.Qwen3ForCausalLM
    else:
        raise ValueError(arch)
    return save_random_model(path, cls, config, tokenizer, seed)


def save_random_model(path, cls, config, tokenizer, seed: int, adjust=None):
    """A float32 model of `cls` with random weights, saved with `tokenizer`; `adjust(model)`, if given, changes
    some of them first (under no_grad)."""
    torch.manual_seed(seed)
    model = cls(config).float().eval()
    with torch.no_grad():  # larger weights than the default init make the logits less flat
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
        if adjust is not None:
            adjust(model)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_models")
    return {arch: build_tiny_model(root / arch, arch) for arch in ARCHITECTURES}


# The files whose tests take minutes (scripts/test.sh's two workers, session 17: 100-300 s each). Collected
# first, and with xdist's `--no-loadscope-reorder` handed out first, so that no worker starts one of them
# while the other has nothing left to do.
LONG_FILES = ("test_bench_shards.py", "test_prompt_logprobs.py", "test_structured.py", "test_ray_chaos.py",
              "test_buckets.py", "test_reproducibility.py", "test_kv_fp8.py", "test_beam_search.py",
              "test_cuda_compile.py", "test_cuda_emulated.py", "test_job_structured.py", "test_ray.py")


def pytest_collection_modifyitems(config, items):
    """A test on the real SmolLM2 must be marked slow, so that `-m "not slow"` leaves it out. The long
    files go first (a stable sort: each file's tests keep their order)."""
    items.sort(key=lambda item: item.path.name not in LONG_FILES)
    unmarked = [item.nodeid for item in items
                if "smollm2_dir" in getattr(item, "fixturenames", ()) and item.get_closest_marker("slow") is None]
    if unmarked:
        raise pytest.UsageError(f"tests on the real SmolLM2 without @pytest.mark.slow: {', '.join(unmarked)}")


@pytest.fixture(scope="session")
def smollm2_dir():
    from batchgen.models.smollm2 import ensure_smollm2

    return ensure_smollm2()


@pytest.fixture(autouse=True)
def _kernel_table_restored():
    """Each test ends with the kernel table it started with: a test that switches it (`set_cpu_isa`) and fails
    half-way must not leave the next test on another table."""
    from batchgen import _C

    active = _C.cpu_isa()
    yield
    if _C.cpu_isa() != active:
        _C.set_cpu_isa(active)


@pytest.fixture
def kernels(request):
    """The kernel table a test runs under (parametrize it indirectly): "own", the processor's, or one named, such
    as "avx512" or "avx2", whose bf16 GEMM widens the pairs to float32 FMAs (Intel's AVX-512 Xeons without
    AVX512-BF16; AMD Zen 2 and 3). A table this processor cannot run skips the test. `_kernel_table_restored` puts
    the processor's back after."""
    from batchgen import _C

    if request.param != "own":
        if request.param not in _C.supported_cpu_isas():
            pytest.skip(f"no {request.param} kernels on this processor")
        _C.set_cpu_isa(request.param)
    return _C.cpu_isa()


@pytest.fixture
def cpu_isas():
    """Every instruction set the CPU kernels were built for; the one active before the test is
    active again after it, whichever the test switched to."""
    from batchgen import _C

    active = _C.cpu_isa()
    yield _C.supported_cpu_isas()
    _C.set_cpu_isa(active)


@pytest.fixture
def isas(device, cpu_isas):
    """For tests parametrized by `device`: the CPU instruction sets to run each case on (cpu_isas), or [None] on
    CUDA, where there is one implementation (kernel_cases.use_isa switches to each)."""
    return cpu_isas if device == "cpu" else [None]


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 server on 127.0.0.1 (a free port) for the whole session, its variables set in
    this process (subprocesses inherit them); each test makes its own bucket."""
    from s3_server import S3Server, apply_env, restore_env

    server = S3Server().start()
    old = apply_env(server.env())
    yield server
    restore_env(old)
    server.stop()


@pytest.fixture
def bucket(s3_server, request):
    """A fresh, empty bucket named after the test; its ``s3://`` URL."""
    import re
    import uuid

    name = re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:40].strip("-") + "-" + uuid.uuid4().hex[:8]
    s3_server.make_bucket(name)
    return f"s3://{name}"
