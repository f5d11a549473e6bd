"""Mixtures of experts on the transformers backend: the experts packed per expert (layers/experts.py) against a
pure-torch reference, each token's result independent of the batch, routers on tall-matrix kernels, and seeded
output the same however the engine batches it. (Greedy parity with transformers' generate: test_model_impl.py,
whose zoo holds the MoE families.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_cases import moe_routing, rel_err, tolerance
from model_zoo import MOE, build_zoo_model, save_mxfp4_gpt_oss
from test_reproducibility import TINY_BLOCK, VARIANTS, check_variants, seeded, tiny_prompts

from batchgen import LLM, SamplingParams, ops
from batchgen.layers.experts import PackedExperts
from batchgen.layers.linear import MIN_ROWS, Int8Linear, Int8SiluAndMul, PackedLinear, forward_on_min_rows
from batchgen.models.transformers_backend import expert_layers
from batchgen.ops import reference as ops_reference

EXPERTS, HIDDEN, WIDTH, K = 6, 64, 64, 2
# WIDTH a multiple of 64: the unfused gate here is torch's F.silu itself, whose last elements of a tensor not a
# multiple of the vector width go through a scalar path (the backend runs models' activations through
# layers/elementwise.invariant; tests/test_elementwise.py).


def reference(hidden, ids, weights, up, down, *, transposed=False, up_bias=None, down_bias=None, fused=True,
              act=F.silu):
    """Each token's sum over its experts of weight * down(gate(up(x))), in float64."""
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    for t in range(hidden.shape[0]):
        for rank in range(ids.shape[1]):
            e = int(ids[t, rank])
            w_up, w_down = (w[e].double() for w in (up, down))
            if transposed:
                w_up, w_down = w_up.t(), w_down.t()
            x = hidden[t].double() @ w_up.t() + (0 if up_bias is None else up_bias[e].double())
            if fused:
                gate, x_up = x.chunk(2)
                x = act(gate) * x_up
            else:
                x = act(x)
            x = x @ w_down.t() + (0 if down_bias is None else down_bias[e].double())
            out[t] += weights[t, rank].double() * x
    return out


def routing(tokens: int, seed: int = 0):
    return moe_routing(tokens, K, EXPERTS, torch.Generator().manual_seed(seed))


LAYOUTS = {
    "silu-gated": dict(fused=True),
    "transposed,ungated,biased": dict(transposed=True, fused=False, bias=True),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_experts_match_the_reference_and_each_row_is_its_own(dtype, layout):
    options = LAYOUTS[layout]
    gen = torch.Generator().manual_seed(1)
    out_up = 2 * WIDTH if options["fused"] else WIDTH
    up_shape, down_shape = (EXPERTS, out_up, HIDDEN), (EXPERTS, HIDDEN, WIDTH)
    if options.get("transposed"):
        up_shape, down_shape = (EXPERTS, HIDDEN, out_up), (EXPERTS, WIDTH, HIDDEN)
    up = (torch.randn(up_shape, generator=gen) * 0.2).to(dtype)
    down = (torch.randn(down_shape, generator=gen) * 0.2).to(dtype)
    biases = {}
    if options.get("bias"):
        biases = dict(up_bias=torch.randn(EXPERTS, out_up, generator=gen).to(dtype),
                      down_bias=torch.randn(EXPERTS, HIDDEN, generator=gen).to(dtype))
    experts = PackedExperts.pack(up, down, transposed=options.get("transposed", False), fused_silu=options["fused"],
                                 gate_fn=None if options["fused"] else F.silu, **biases)
    hidden = torch.randn(40, HIDDEN, generator=gen).to(dtype)
    ids, weights = routing(40)
    got = experts(hidden, ids, weights.to(dtype))
    assert got.dtype == dtype and got.shape == hidden.shape
    want = reference(hidden, ids, weights.to(dtype), up, down, transposed=options.get("transposed", False),
                     fused=options["fused"], **biases)
    assert rel_err(got, want) < (tolerance(dtype) if dtype == torch.float32 else 2e-2)
    # A token's bits do not depend on the other tokens of the call: alone, in a few, in another order.
    for rows in ([7], [0, 1, 2], list(range(39, 14, -1))):
        part = experts(hidden[rows], ids[rows], weights.to(dtype)[rows])
        assert torch.equal(part, got[rows]), rows
    # bf16 SiLU-gated experts on batchgen's panels run as one C++ call a layer: the loop's bits.
    assert experts.one_call == (options["fused"] and dtype == torch.bfloat16 and ops.has_gemm_bf16())
    if experts.one_call:
        experts.one_call = False
        assert torch.equal(experts(hidden, ids, weights.to(dtype)), got)


def int8_reference(hidden, ids, weights, up, down):
    """Each token's sum, in ascending expert order, of weight * its experts' int8 projections (the pure-torch
    int8 ops of batchgen.ops.reference: gate, up and the SiLU rounded to hidden's dtype, down's sums in float32)."""
    return ops_reference.moe_silu_experts_int8(hidden, ids, weights, [ops.pack_int8_gate_up(w) for w in up],
                                               [ops.pack_int8_weight(w) for w in down])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_experts_are_the_int8_projections_summed_in_expert_order(dtype):
    gen = torch.Generator().manual_seed(5)
    up = (torch.randn(EXPERTS, 2 * WIDTH, HIDDEN, generator=gen) * 0.2).to(dtype)
    down = (torch.randn(EXPERTS, HIDDEN, WIDTH, generator=gen) * 0.2).to(dtype)
    experts = PackedExperts.pack(up, down, fused_silu=True, int8=True)
    assert experts.one_call and experts.int8
    assert all(isinstance(m, Int8SiluAndMul) for m in experts.up)
    assert all(isinstance(m, Int8Linear) for m in experts.down)
    hidden = torch.randn(40, HIDDEN, generator=gen).to(dtype)
    ids, weights = routing(40, seed=5)
    got = experts(hidden, ids, weights)
    assert got.dtype == dtype
    want = int8_reference(hidden, ids, weights, up, down)
    assert rel_err(got, want) < (1e-5 if dtype == torch.float32 else 1e-2)
    float_model = reference(hidden, ids, weights, up, down)
    assert 1e-4 < rel_err(got, float_model) < 0.05  # int8 really ran, within int8's error
    for rows in ([7], [0, 1, 2], list(range(39, 14, -1))):
        assert torch.equal(experts(hidden[rows], ids[rows], weights[rows]), got[rows]), rows
    experts.one_call = False  # the loop an expert at a time: the same bits
    assert torch.equal(experts(hidden, ids, weights), got)


def test_routers_are_called_on_tall_matrix_kernels():
    """A router's F.linear rows must not depend on the step's row count (BLAS kernels for a few rows round
    differently): run on at least MIN_ROWS rows, cut back, whatever it returns."""

    class Router(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(8, 96, generator=torch.Generator().manual_seed(2)))

        def forward(self, x, scale=1.0):
            logits = F.linear(x.reshape(-1, x.shape[-1]), self.weight) * scale
            values, ids = torch.topk(logits.softmax(-1), 2)
            return logits, values, ids

    router = Router()
    forward_on_min_rows(router)
    x = torch.randn(64, 96, generator=torch.Generator().manual_seed(3))
    full = router(x)
    for rows in range(1, MIN_ROWS + 1):
        for got in (router(x[:rows]), router(x[None, :rows], scale=1.0)):
            assert [t.shape[0] for t in got] == [rows] * 3
            for part, whole in zip(got, full, strict=True):
                assert torch.equal(part, whole[:rows])


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {arch: str(build_zoo_model(root / arch, arch)) for arch in MOE}


@pytest.mark.parametrize("arch", MOE)
def test_the_experts_run_packed_and_their_3d_weights_are_freed(moe_dirs, arch):
    llm = LLM(moe_dirs[arch], dtype="bfloat16", kv_cache_memory="16MiB")
    hf = llm.llm_engine.runner.model.hf
    layers = [m for m in hf.modules() if hasattr(m, "_apply_gate")]
    assert layers and all(isinstance(m.batchgen_experts, PackedExperts) for m in layers)
    assert hf.config._experts_implementation == "batchgen"
    assert not [name for name, p in hf.named_parameters() if p.dim() == 3 and p.numel()]
    assert llm.generate([[5, 6, 7]], seeded(1, n=1)[0], use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_moe_seeded_outputs_do_not_depend_on_how_the_engine_runs_them(moe_dirs, dtype):
    """Before the experts were packed, float32 logprobs changed with max_num_seqs and chunking (transformers'
    grouped_mm over the raw weights, and the routers' F.linear on a few rows)."""
    prompts = tiny_prompts(400)
    block_bytes = TINY_BLOCK * torch.empty((), dtype=getattr(torch, dtype)).element_size()
    variants = VARIANTS if dtype == "bfloat16" else {name: VARIANTS[name] for name in ("max-num-seqs-2", "chunked")}
    check_variants(moe_dirs["qwen3_moe"], dtype, prompts, seeded(len(prompts)), block_bytes,
                   {"kv_cache_memory": "32MiB", "swap_space": "8MiB"}, variants)


def test_lora_adapters_on_a_moe_match_peft(moe_dirs, tmp_path):
    """Attention adapters on Phi-3.5-MoE, whose router is an nn.Linear subclass returning its routing: offered to
    no adapter (wrapping it as a projection broke every step), the adapted model's greedy tokens are PEFT's."""
    import peft
    import transformers as tf
    from lora_kit import hf_greedy, make_adapter, prompts_of

    from batchgen import LoRARequest, SamplingParams

    adapter = make_adapter(moe_dirs["phimoe"], tmp_path / "adapter", 8, ["q_proj", "v_proj", "o_proj"], seed=1)
    prompts = prompts_of(400, lens=(3, 17, 40), seed=2)
    hf = tf.AutoModelForCausalLM.from_pretrained(moe_dirs["phimoe"], dtype=torch.float32)
    want = hf_greedy(peft.PeftModel.from_pretrained(hf, adapter).eval(), prompts)
    llm = LLM(moe_dirs["phimoe"], dtype="float32", enable_lora=True, max_lora_rank=8, kv_cache_memory="16MiB")
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False,
                           lora_request=LoRARequest("a", 1, str(adapter)))
    assert [o.outputs[0].token_ids for o in outputs] == want


def test_int8_moe_runs_experts_and_projections_on_int8_but_the_shared_experts_gate(tmp_path):
    """quantization="int8" on the transformers backend: the experts, the attention projections and the shared
    expert's MLP on int8; the linear of one output that weighs the shared expert stays in the model's dtype."""
    model_dir = str(build_zoo_model(tmp_path / "qwen2_moe", "qwen2_moe"))
    prompts = [[5, 6, 7, 8, 9, 10]]
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=1, ignore_eos=True)
    outputs = {}
    for quantization in (None, "int8"):
        llm = LLM(model_dir, dtype="bfloat16", kv_cache_memory="16MiB", quantization=quantization)
        outputs[quantization] = llm.generate(prompts, params, use_tqdm=False)[0].outputs[0]
    hf = llm.llm_engine.runner.model.hf
    layers = expert_layers(hf)
    assert layers and all(isinstance(m, Int8SiluAndMul) for layer in layers for m in layer.batchgen_experts.up)
    assert all(isinstance(m, Int8Linear) for layer in layers for m in layer.batchgen_experts.down)
    assert not [name for name, p in hf.named_parameters() if p.dim() == 3 and p.numel()]
    block = hf.model.layers[0].mlp
    assert isinstance(block.shared_expert_gate, PackedLinear)  # packed in bf16, its rows the batch's own
    assert isinstance(block.shared_expert.gate_proj, Int8Linear) and isinstance(hf.model.layers[0].self_attn.q_proj,
                                                                                   Int8Linear)
    assert outputs["int8"].logprobs != outputs[None].logprobs  # int8 really ran


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_int8_moe_seeded_outputs_do_not_depend_on_how_the_engine_runs_them(moe_dirs, tmp_path, arch):
    """Qwen2-MoE: its shared expert's gate stays in bf16, on packed (row-independent) kernels too."""
    model_dir = moe_dirs[arch] if arch in moe_dirs else str(build_zoo_model(tmp_path / arch, arch))
    prompts = tiny_prompts(400)
    block_bytes = TINY_BLOCK * 2
    variants = {name: VARIANTS[name] for name in ("max-num-seqs-2", "chunked", "swap")}
    check_variants(model_dir, "bfloat16", prompts, seeded(len(prompts)), block_bytes,
                   {"kv_cache_memory": "32MiB", "swap_space": "8MiB", "quantization": "int8"}, variants)


def test_gpt_oss_guide_example_runs_in_bf16_and_on_int8(moe_dirs, capsys):
    """docs/models.md's GPT-OSS example as written, on the tiny GPT-OSS (attention sinks, experts with biases) in
    place of the checkpoint it names; and the same model on int8, its experts' biased projections on Int8Linear."""
    from test_int8_engine import run_guide_example

    run_guide_example("gpt-oss", "~/models/gpt-oss-20b", moe_dirs["gpt_oss"], capsys, page="models.md")
    llm = LLM(moe_dirs["gpt_oss"], dtype="bfloat16", kv_cache_memory="16MiB", quantization="int8")
    experts = expert_layers(llm.llm_engine.runner.model.hf)
    assert experts and all(isinstance(m, Int8Linear) and m.bias is not None
                           for layer in experts for m in layer.batchgen_experts.up)
    output = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0]
    assert len(output.token_ids) == 4


def test_an_mxfp4_gpt_oss_checkpoint_runs_dequantized_and_matches_transformers(moe_dirs, tmp_path):
    """GPT-OSS as released: its experts in MXFP4. batchgen loads them dequantized (transformers would otherwise
    fetch MXFP4 kernels from the hub, the `kernels` package being installed here) and packs them; greedy output in
    float32 is transformers' own on the same dequantized weights, which decode to exactly the values encoded."""
    import transformers as tf
    from lora_kit import hf_greedy, prompts_of

    decoded = save_mxfp4_gpt_oss(moe_dirs["gpt_oss"], tmp_path / "mxfp4")
    hf = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "mxfp4", dtype=torch.float32, attn_implementation="eager",
                                                 quantization_config=tf.Mxfp4Config(dequantize=True))
    assert decoded and all(torch.equal(hf.get_parameter(name), values) for name, values in decoded.items())
    prompts = prompts_of(hf.config.vocab_size, lens=(3, 17, 40), seed=3)
    llm = LLM(str(tmp_path / "mxfp4"), dtype="float32", kv_cache_memory="16MiB")
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(hf.eval(), prompts)
    layers = expert_layers(llm.llm_engine.runner.model.hf)
    assert layers and all(isinstance(m.batchgen_experts, PackedExperts) for m in layers)


def test_mxfp4_checkpoints_and_only_they_are_loaded_dequantized():
    """Whatever this environment has installed (the MXFP4 test above passes without the override where transformers
    dequantizes by itself): a config's mxfp4, as config.json's dict or as transformers' config object, asks for
    dequantization; other quantizations and none ask for nothing."""
    import transformers as tf

    from batchgen.models.transformers_backend import _dequantized

    for quantization in ({"quant_method": "mxfp4"}, tf.Mxfp4Config()):
        (config,) = _dequantized(tf.GptOssConfig(quantization_config=quantization)).values()
        assert isinstance(config, tf.Mxfp4Config) and config.dequantize
    assert _dequantized(tf.GptOssConfig()) == {}
    assert _dequantized(tf.LlamaConfig(quantization_config={"quant_method": "compressed-tensors"})) == {}

