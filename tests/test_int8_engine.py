"""The int8 engine path (`LLM(model, quantization="int8")`, docs/int8.md) on a tiny Llama: greedy outputs
token for token those of an int8 pure-torch reference model (transformers' model with each projection
replaced by the same quantization simulated in torch, `batchgen.ops.reference.linear_int8`), rows alone the
same as in a batch, the layers in one call (`ops.DecoderStack` on int8 projections) the same as the Python layers
bit for bit, and the option refused where it cannot run.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
import torch
import transformers as tf
from conftest import ARCHITECTURES
from jobkit import REPO, cli, job_dict, setup_job, write_job
from test_decoder_stack import CountingStack, run
from test_llm import GREEDY, MAX_NEW, make_prompts, tokens
from torch import nn

from batchgen import _C, LLM, SamplingParams, ops
from batchgen.config import ConfigError
from batchgen.job.spec import _drop_later_defaults, load_job
from batchgen.layers.linear import Int8Linear
from batchgen.models.transformers_backend import TransformersModel
from batchgen.ops import Int8Weight, pack_int8_weight, reference

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class ReferenceInt8Linear(nn.Module):
    def __init__(self, linear: nn.Linear, weight: Int8Weight):
        super().__init__()
        self.weight = weight
        self.bias = None if linear.bias is None else linear.bias.detach().float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        return reference.linear_int8(rows, self.weight, self.bias).view(*x.shape[:-1], -1)


def int8_reference_model(model_dir, int8_weight: Callable[[str, nn.Linear], Int8Weight] | None = None) -> nn.Module:
    """transformers' float32 model with each projection on `reference.linear_int8`, its int8 weight
    `int8_weight(qualified name, linear)` (default: the linear's weight quantized as batchgen does at load)."""
    hf = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    int8_weight = int8_weight or (lambda _, linear: pack_int8_weight(linear.weight))
    replaced = 0
    for owner, module in list(hf.named_modules()):
        for name in PROJECTIONS:
            if isinstance(linear := getattr(module, name, None), nn.Linear):
                setattr(module, name, ReferenceInt8Linear(linear, int8_weight(f"{owner}.{name}", linear)))
                replaced += 1
    assert replaced == len(PROJECTIONS) * hf.config.num_hidden_layers
    return hf


def greedy(hf: nn.Module, prompt: list[int]) -> list[int]:
    x = torch.tensor([prompt])
    out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW,
                      do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


NEAR_TIE = 0.02  # logits of the tiny model are ~2-3: 1% of a logit


def first_difference(hf: nn.Module, prompt: list[int], got: list[int], want: list[int]) -> tuple[int, float] | None:
    """Where `got` first leaves `want` and by how much the reference preferred its token there (None: never)."""
    at = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)
    if at is None:
        return None
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + want[:at]])).logits[0, -1]
    return at, float(logits[want[at]] - logits[got[at]])


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_matches_the_int8_reference_model(tiny_model_dirs, arch):
    """Token for token, but for near-ties: batchgen's float32 ops (attention, norms) round a few ulps differently
    from transformers', and now and then such a difference moves an activation across a rounding boundary of
    its quantization, a one-step change in one int8 value that can tip two logits within ~1% of each other."""
    model_dir = tiny_model_dirs[arch]
    hf = int8_reference_model(model_dir)
    prompts = make_prompts(hf.config.vocab_size)
    llm = LLM(model_dir, dtype="float32", quantization="int8", kv_cache_memory="32MiB", max_num_batched_tokens=256)
    got = assert_greedy_matches(hf, llm, prompts)
    plain = LLM(model_dir, dtype="float32", kv_cache_memory="32MiB", max_num_batched_tokens=256)
    assert got != tokens(plain.generate(prompts, GREEDY, use_tqdm=False))  # int8 really ran


def assert_greedy_matches(hf: nn.Module, llm: LLM, prompts: list[list[int]],
                          near_tie: float = NEAR_TIE) -> list[list[int]]:
    """`llm`'s greedy tokens are `hf`'s but for at most 3 prompts parting at a near-tie (see above); returns them."""
    got = tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    differences = [first_difference(hf, p, g, greedy(hf, p)) for p, g in zip(prompts, got, strict=True)]
    assert sum(d is None for d in differences) >= len(prompts) - 3, differences
    assert all(d is None or d[1] < near_tie for d in differences), differences
    return got


def test_the_transformers_backend_matches_the_int8_reference_model(tiny_model_dirs):
    """model_impl="transformers": transformers' own layers, each projection an `Int8Linear` (gate and up apart,
    transformers' SiLU between), greedy as the reference but for near-ties."""
    model_dir = tiny_model_dirs["llama"]
    hf = int8_reference_model(model_dir)
    llm = LLM(model_dir, dtype="float32", quantization="int8", model_impl="transformers", kv_cache_memory="32MiB",
              max_num_batched_tokens=256)
    model = llm.engine.runner.model
    assert isinstance(model, TransformersModel)
    int8 = [name for name, m in model.hf.named_modules() if isinstance(m, Int8Linear)]
    assert len(int8) == len(PROJECTIONS) * hf.config.num_hidden_layers, int8
    assert_greedy_matches(hf, llm, make_prompts(hf.config.vocab_size))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_row_alone_equals_the_row_in_a_batch(tiny_model_dirs, dtype):
    llm = LLM(tiny_model_dirs["llama"], dtype=dtype, quantization="int8", kv_cache_memory="32MiB",
              max_num_seqs=8, max_num_batched_tokens=64)
    prompts = make_prompts(llm.engine.vocab_size, lens=[3, 17, 40, 90, 5, 64], seed=4)
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=16, ignore_eos=True, logprobs=1)
              for i in range(len(prompts))]
    batched = llm.generate(prompts, params, use_tqdm=False)
    for prompt, p, together in zip(prompts, params, batched, strict=True):
        alone = llm.generate([prompt], [p], use_tqdm=False)[0]
        assert alone.outputs[0].token_ids == together.outputs[0].token_ids
        assert alone.outputs[0].logprobs == together.outputs[0].logprobs


@pytest.mark.parametrize(("arch", "dtype"), [("llama", "bfloat16"), ("qwen2", "float32"), ("qwen3", "bfloat16")])
def test_the_int8_stack_gives_the_python_layers_results_bit_for_bit(tiny_model_dirs, arch, dtype):
    """A bias on qkv (Qwen2), q/k norms (Qwen3)."""
    llm = LLM(tiny_model_dirs[arch], dtype=dtype, quantization="int8", kv_cache_memory="32MiB",
              max_num_batched_tokens=64, max_num_seqs=16, enable_prefix_caching=False)
    stack = llm.engine.runner.model.decoder_stack
    assert stack is not None and stack.num_layers == 2
    counting = CountingStack(stack)
    ours, theirs = run(llm, counting), run(llm, None)
    assert counting.calls > 0
    seconds = stack.op_seconds()
    assert seconds["qkv"] > 0 and seconds["gate_up"] > 0 and seconds["down"] > 0
    for a, b in zip(ours, theirs, strict=True):
        for x, y in zip(a.outputs, b.outputs, strict=True):
            assert x.token_ids == y.token_ids
            assert x.logprobs == y.logprobs and x.cumulative_logprob == y.cumulative_logprob


def test_the_int8_stack_runs_on_every_kernel_table(tiny_model_dirs, cpu_isas):
    """The int8 loops need no bf16 GEMM: the stack runs where the bf16 stack falls back to the Python layers."""
    llm = LLM(tiny_model_dirs["llama"], dtype="bfloat16", quantization="int8", kv_cache_memory="32MiB")
    model = llm.engine.runner.model
    stack = model.decoder_stack
    for isa in cpu_isas:
        _C.set_cpu_isa(isa)
        model.decoder_stack = counting = CountingStack(stack)
        assert llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3), use_tqdm=False)[0].outputs[0].token_ids
        assert counting.calls > 0, isa


def test_the_int8_stack_refuses_lora():
    stack = ops.DecoderStack([[torch.empty(0)] * 7], [None], 4, 2, 64, 128, 256, 1e-6, 0.125,
                             int8=[[(torch.empty(0), torch.empty(0))] * 4])
    with pytest.raises(ValueError, match="LoRA needs bf16 projections, not int8"):
        stack.set_lora([[[], [], [], []]])
    with pytest.raises(ValueError, match="needs the int8 .* of qkv, o, gate_up and down, got 3"):
        ops.DecoderStack([[torch.empty(0)] * 7], [None], 4, 2, 64, 128, 256, 1e-6, 0.125,
                         int8=[[(torch.empty(0), torch.empty(0))] * 3])


def test_unknown_or_impossible_quantization_is_refused(tiny_model_dirs):
    with pytest.raises(ConfigError, match=r"^quantization: must be int8 or unset \(got 'int4'\)$"):
        LLM(tiny_model_dirs["llama"], quantization="int4")
    with pytest.raises(ConfigError, match="quantization: int8 cannot be combined with enable_lora"):
        LLM(tiny_model_dirs["llama"], quantization="int8", enable_lora=True)
    with pytest.raises(ConfigError, match="quantization: int8 takes float32 or bfloat16"):
        LLM(tiny_model_dirs["llama"], quantization="int8", dtype="float16")


def test_job_files_take_model_quantization(tmp_path):
    setup_job(tmp_path)
    base = load_job(write_job(tmp_path / "a.yaml", job_dict()))
    int8 = load_job(write_job(tmp_path / "b.yaml", job_dict(model={"path": "model", "quantization": "int8"})))
    fields = base.config_fields()
    _drop_later_defaults(fields)
    assert "quantization" not in fields["model"]  # jobs from before the option keep their hash
    assert int8.config_hash != base.config_hash
    assert int8.spec.model.engine_kwargs(tmp_path)["quantization"] == "int8"
    assert "quantization" not in base.spec.model.engine_kwargs(tmp_path)
    r = cli("validate", write_job(tmp_path / "c.yaml", job_dict(model={"path": "model", "quantization": "int4"})))
    problems = [line for line in r.stderr.splitlines() if line.startswith("model.quantization")]
    assert r.exit_code == 1 and len(problems) == 1 and "int8" in problems[0], r.output
    assert "Traceback" not in r.output


def test_guide_example_runs(tiny_model_dirs, capsys):
    """docs/int8.md's example as written, on the tiny Llama in place of the path it names."""
    run_guide_example("int8", "~/.cache/batchgen/models/SmolLM2-135M-Instruct", tiny_model_dirs["llama"], capsys)


def run_guide_example(marker: str, path: str, model_dir, capsys, page: str = "int8.md") -> None:
    """Runs docs/`page`'s python block marked `marker` with `model_dir` for the model `path` it names; it prints
    a text's repr."""
    guide = (REPO / "docs" / page).read_text(encoding="utf-8")
    (code,) = re.findall(rf"<!-- readme-test: python {marker} -->\n```python\n(.*?)```", guide, re.S)
    assert path in code
    exec(code.replace(path, str(model_dir)), {})
    printed = capsys.readouterr().out
    assert printed.startswith("'") and len(printed) > 3
