"""Checkpoints quantized ahead (compressed-tensors int8 W8A8, docs/int8.md): written by the compressed-tensors
library itself from the tiny models (scripts/w8a8.py), they run on the int8 path with their own int8 values
and scales (-128 included), token for token like an int8 reference model built from those values; one written
with batchgen's own rounding runs exactly like `quantization="int8"` on the float model; a head the checkpoint
quantized runs dequantized in the model's dtype; every scheme batchgen does not run is refused in one line.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from conftest import ARCHITECTURES
from jobkit import REPO, cli, job_dict, setup_job, write_job
from model_zoo import build_zoo_model
from safetensors import safe_open
from safetensors.torch import save_file
from test_int8_engine import assert_greedy_matches, int8_reference_model, run_guide_example
from test_llm import make_prompts

from batchgen import LLM, SamplingParams
from batchgen.config import ConfigError
from batchgen.layers.linear import Int8Linear
from batchgen.ops import pack_int8_weight, quantize_int8_weight

W8A8 = REPO / "scripts" / "w8a8.py"
spec = importlib.util.spec_from_file_location("w8a8", W8A8)
w8a8 = importlib.util.module_from_spec(spec)
spec.loader.exec_module(w8a8)


def checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def checkpoint_weights(tensors: dict[str, torch.Tensor], own_where_float: bool = False):
    """For `int8_reference_model`: each projection's int8 weight from the checkpoint's values and scales; with
    `own_where_float`, a projection the checkpoint holds in float quantized by batchgen's rule (a KeyError
    otherwise)."""

    def weight(name: str, linear: torch.nn.Linear):
        if own_where_float and f"{name}.weight_scale" not in tensors:
            return pack_int8_weight(linear.weight)
        return pack_int8_weight(tensors[f"{name}.weight"], tensors[f"{name}.weight_scale"])

    return weight


@pytest.fixture(scope="module")
def w8a8_dirs(tiny_model_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("w8a8")
    return {arch: w8a8.write_w8a8(tiny_model_dirs[arch], root / arch) for arch in ARCHITECTURES}


def test_the_library_writes_what_batchgen_reads(w8a8_dirs):
    """The format as compressed-tensors writes it today: int8 weights reaching -128, a float32 scale per
    output feature, no zero points, and the config batchgen accepts."""
    tensors = checkpoint_tensors(w8a8_dirs["llama"])
    q, scale = tensors["model.layers.0.mlp.down_proj.weight"], tensors["model.layers.0.mlp.down_proj.weight_scale"]
    assert q.dtype == torch.int8 and int(q.min()) == -128 and scale.shape == (q.shape[0], 1)
    assert not any(name.endswith("zero_point") for name in tensors)
    config = json.loads((w8a8_dirs["llama"] / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors" and config["format"] == "int-quantized"


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_matches_the_checkpoints_int8_reference(tiny_model_dirs, w8a8_dirs, arch, caplog):
    """No `quantization` option: the checkpoint asks for int8 itself (and the log says so). The reference is
    transformers' model with each projection on `reference.linear_int8` over the checkpoint's own values and
    scales."""
    tensors = checkpoint_tensors(w8a8_dirs[arch])

    hf = int8_reference_model(tiny_model_dirs[arch], checkpoint_weights(tensors))
    with caplog.at_level("INFO", logger="batchgen"):
        llm = LLM(w8a8_dirs[arch], dtype="float32", kv_cache_memory="32MiB", max_num_batched_tokens=256)
    assert any("(float32, cpu, int8 compute)" in r.getMessage() for r in caplog.records), caplog.text
    model = llm.engine.runner.model
    assert isinstance(model.layers[0].self_attn.o_proj, Int8Linear) and model.decoder_stack is not None
    assert_greedy_matches(hf, llm, make_prompts(hf.config.vocab_size))


def test_one_scale_per_weight_is_taken_for_all_its_features(tiny_model_dirs, tmp_path):
    """Weights quantized per tensor: q, k and v each bring one scale, which fills their rows of the fused scales.
    One prompt of 16 parts from the reference at a near-tie of 0.032 (1.3% of a logit), a little wider than the
    per-channel tests meet."""
    src = tiny_model_dirs["llama"]
    checkpoint = w8a8.write_w8a8(src, tmp_path / "w8a8", strategy="tensor")
    tensors = checkpoint_tensors(checkpoint)
    assert tensors["model.layers.0.self_attn.k_proj.weight_scale"].numel() == 1

    hf = int8_reference_model(src, checkpoint_weights(tensors))
    llm = LLM(checkpoint, dtype="float32", kv_cache_memory="32MiB", max_num_batched_tokens=256)
    scales = llm.engine.runner.model.layers[0].self_attn.qkv_proj.weight.scale
    assert len(set(scales[:512].tolist())) == 3  # q's 256 rows, k's 128, v's 128
    assert_greedy_matches(hf, llm, make_prompts(hf.config.vocab_size), near_tie=0.05)


def test_a_projection_the_checkpoint_left_in_float_is_quantized_at_load(tiny_model_dirs, tmp_path):
    """An `ignore`d layer projection: batchgen's own rounding at load, so that every layer still runs on int8."""
    src = tiny_model_dirs["llama"]
    checkpoint = w8a8.write_w8a8(src, tmp_path / "w8a8", ignore=("lm_head", "re:.*layers[.]1[.]mlp[.]down_proj$"))
    tensors = checkpoint_tensors(checkpoint)
    assert "model.layers.1.mlp.down_proj.weight_scale" not in tensors
    assert "model.layers.0.mlp.down_proj.weight_scale" in tensors

    hf = int8_reference_model(src, checkpoint_weights(tensors, own_where_float=True))
    llm = LLM(checkpoint, dtype="float32", kv_cache_memory="32MiB", max_num_batched_tokens=256)
    assert isinstance(llm.engine.runner.model.layers[1].mlp.down_proj, Int8Linear)
    assert_greedy_matches(hf, llm, make_prompts(hf.config.vocab_size))


def own_rounding_checkpoint(src: Path, dst: Path, library_checkpoint: Path, quantize_head: bool) -> Path:
    """The float model at `src` rounded to bf16 and quantized by batchgen's own rule (`quantize_int8_weight`), as
    `quantization="int8"` does when it loads the model in bf16, and written in the compressed-tensors format by
    hand (the library's config), with the all-zero weight zero points older writers kept and the scales as a
    vector, not the library's column."""
    tensors = checkpoint_tensors(src)
    targets = [name.removesuffix(".weight") for name in tensors
               if re.search(r"_proj\.weight$", name) or (quantize_head and name == "lm_head.weight")]
    for name in targets:
        q, scale = quantize_int8_weight(tensors[f"{name}.weight"].bfloat16())
        tensors |= {f"{name}.weight": q, f"{name}.weight_scale": scale,
                    f"{name}.weight_zero_point": torch.zeros(q.shape[0], 1, dtype=torch.int8)}
    dst.mkdir()
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    library = json.loads((library_checkpoint / "config.json").read_text())["quantization_config"]
    config["quantization_config"] = library | {"ignore": [] if quantize_head else ["lm_head"]}
    (dst / "config.json").write_text(json.dumps(config))
    w8a8.copy_tokenizer(src, dst)
    return dst


@pytest.mark.parametrize("quantize_head", [False, True], ids=["head-float", "head-int8"])
def test_a_checkpoint_of_batchgens_rounding_runs_exactly_as_the_int8_mode(tiny_model_dirs, w8a8_dirs, tmp_path,
                                                                          quantize_head):
    """The same int8 values and scales as `quantization="int8"` computes at load, so the same panels: tokens and
    logprobs equal bit for bit, sampled. A quantized head is dequantized (q * scale) into the model's dtype: the
    float model then gets that head too."""
    src = tiny_model_dirs["llama"]
    checkpoint = own_rounding_checkpoint(src, tmp_path / "w8a8", w8a8_dirs["llama"], quantize_head)
    if quantize_head:
        tensors = checkpoint_tensors(src)
        q, scale = quantize_int8_weight(tensors["lm_head.weight"].bfloat16())
        tensors["lm_head.weight"] = q.float() * scale[:, None]
        (tmp_path / "float").mkdir()
        save_file(tensors, str(tmp_path / "float" / "model.safetensors"), metadata={"format": "pt"})
        shutil.copy(src / "config.json", tmp_path / "float")
        w8a8.copy_tokenizer(src, tmp_path / "float")
        src = tmp_path / "float"
    assert_runs_as_the_int8_mode(checkpoint, src)


@pytest.mark.parametrize("arch", ["phi3", "gemma3"])
def test_other_families_run_a_checkpoint_exactly_as_the_int8_mode(w8a8_dirs, tmp_path, arch):
    """Phi-3 holds q/k/v and gate/up fused in its checkpoint, so their scales come fused too; Gemma 3 runs gate
    and up as one plain projection, in the Python layers."""
    src = build_zoo_model(tmp_path / arch, arch)
    checkpoint = own_rounding_checkpoint(src, tmp_path / "w8a8", w8a8_dirs["llama"], quantize_head=False)
    assert_runs_as_the_int8_mode(checkpoint, src)


def assert_runs_as_the_int8_mode(checkpoint: Path, float_model: Path) -> None:
    """Sampled tokens and their logprobs of `checkpoint` equal, bit for bit, those of `float_model` with
    quantization="int8"."""
    prompts = make_prompts(400, lens=[3, 17, 40, 90], seed=2)
    params = [SamplingParams(temperature=0.9, seed=i, max_tokens=12, ignore_eos=True, logprobs=2)
              for i in range(len(prompts))]
    options = dict(dtype="bfloat16", kv_cache_memory="32MiB")
    ours = LLM(checkpoint, **options)
    assert any(isinstance(m, Int8Linear) for m in ours.engine.runner.model.modules())
    mode = LLM(float_model, quantization="int8", **options).generate(prompts, params, use_tqdm=False)
    for a, b in zip(ours.generate(prompts, params, use_tqdm=False), mode, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


def _edit_config(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    edit(config["quantization_config"])
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _group(part: str, **values):
    return lambda config: config["config_groups"]["group_0"][part].update(values)


REFUSED = {
    "gptq": (lambda c: c.update(quant_method="gptq"), "quant_method 'gptq' is not supported"),
    "static": (_group("input_activations", dynamic=False), "input_activations are static"),
    "asymmetric": (_group("input_activations", symmetric=False), "input_activations are asymmetric"),
    "per-tensor-activations": (_group("input_activations", strategy="tensor"), "input_activations strategy 'tensor'"),
    "groups": (_group("weights", strategy="group", group_size=32), "weights strategy 'group'"),
    "int4": (_group("weights", num_bits=4), "weights are 4-bit int"),
    "fp8": (_group("weights", type="float"), "weights are 8-bit float"),
    "weight-only": (lambda c: c["config_groups"]["group_0"].update(input_activations=None), "weight-only"),
    "packed": (lambda c: c["config_groups"]["group_0"].update(format="pack-quantized"), "format 'pack-quantized'"),
    "kv-cache": (lambda c: c.update(kv_cache_scheme={"num_bits": 8, "type": "float"}), "kv_cache_scheme"),
    "frozen": (lambda c: c.update(quantization_status="frozen"), "quantization_status 'frozen'"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_schemes_batchgen_does_not_run_are_refused_in_one_line(w8a8_dirs, tmp_path, case):
    edit, message = REFUSED[case]
    model = _edit_config(w8a8_dirs["llama"], tmp_path / case, edit)
    with pytest.raises(ConfigError) as refused:
        LLM(model, kv_cache_memory="32MiB")
    text = str(refused.value)
    assert text.startswith("model: quantization_config") and message in text and "\n" not in text, text


def test_options_the_int8_path_cannot_take_are_refused(w8a8_dirs):
    mode = "model: the checkpoint's int8 quantization (quantization_config)"
    with pytest.raises(ConfigError, match=re.escape(f"{mode} cannot be combined with enable_lora")):
        LLM(w8a8_dirs["llama"], enable_lora=True)
    with pytest.raises(ConfigError, match=re.escape(f"{mode} takes float32 or bfloat16")):
        LLM(w8a8_dirs["llama"], dtype="float16")


def test_a_nonzero_zero_point_is_refused(w8a8_dirs, tmp_path):
    model = shutil.copytree(w8a8_dirs["llama"], tmp_path / "zp")
    tensors = checkpoint_tensors(model)
    tensors["model.layers.1.self_attn.o_proj.weight_zero_point"] = torch.ones(128, 1, dtype=torch.int8)
    save_file(tensors, str(model / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="o_proj.weight_zero_point' is not zero: asymmetric quantization"):
        LLM(model, kv_cache_memory="32MiB")


def test_batchgen_validate_names_the_scheme_in_one_line(w8a8_dirs, tmp_path):
    setup_job(tmp_path)
    model = _edit_config(w8a8_dirs["llama"], tmp_path / "static", REFUSED["static"][0])
    r = cli("validate", write_job(tmp_path / "job.yaml", job_dict(model={"path": str(model)})))
    problems = [line for line in r.stderr.splitlines() if "quantization_config" in line]
    assert r.exit_code == 1 and len(problems) == 1 and "input_activations are static" in problems[0], r.output
    assert "Traceback" not in r.output


def test_guide_example_runs(w8a8_dirs, capsys):
    """docs/int8.md's checkpoint example as written, on a checkpoint the library wrote in place of the one it
    names."""
    run_guide_example("int8-checkpoint", "~/models/Llama-3.2-1B-Instruct-quantized.w8a8", w8a8_dirs["llama"], capsys)
