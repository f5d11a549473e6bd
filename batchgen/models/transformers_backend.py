"""The transformers backend: a model's own transformers code, its attention on batchgen's paged KV cache.

The model is built by `AutoModelForCausalLM.from_pretrained` (`AutoModelForSequenceClassification` for a
classifier) (empty on the meta device, then the
checkpoint's weights, with transformers' own renames and tied weights, in the dtype asked for). Its
attention layers call `batchgen_attention`, registered with transformers' attention interface as
"batchgen": the step's flat batch runs as one row `[1, T]` with its positions, and each layer writes
its K/V with `ops.reshape_and_cache` and attends through the block tables like the native layers.
Everything else (embeddings, positions, norms, MLPs, rotary variants, biases) stays transformers'.
With "batchgen" unknown to transformers' mask interface, no dense T x T mask is built.

LoRA: every linear at `layers.N.<block>.<name>` (the path PEFT names) is offered to adapters under its own
name (`lora_targets`), wrapped so the LoRA layer sees the step's rows as a 2-D batch.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from batchgen import ops
from batchgen.config import ConfigError, ConfigProblem
from batchgen.layers.attention import AttentionMetadata, AttentionVariant, KVScales, paged_attention
from batchgen.layers.elementwise import invariant
from batchgen.layers.experts import PackedExperts
from batchgen.layers.linear import (
    PackedLinear,
    can_pack,
    forward_on_min_rows,
    gather_panels,
    linear,
    logits_head,
    pack_linears,
    plain_linear,
    quantize_linears,
)
from batchgen.layers.lora import LoRATarget
from batchgen.models.architectures import (
    ADAPTED_MODEL_TYPES,
    architecture,
    attention_geometry,
    class_labels,
    is_classifier,
    layer_windows,
    text_config,
)
from batchgen.models.transformers_adapters import adapt_attention

BACKEND = "batchgen"
# Arguments transformers' layers pass for attention the kernels do not have (relative biases).
_UNSUPPORTED_ARGUMENTS = ("position_bias",)
# The names transformers' layers give their attention sinks, one learned score per query head (GPT-OSS: `s_aux`).
_SINK_ARGUMENTS = ("s_aux", "sinks")
_LORA_PATH = re.compile(r"(?:^|\.)layers\.(\d+)\.\w+\.(\w+)$")  # layers.3.self_attn.q_proj


class FlatRows(nn.Module):
    """`inner` called on the step's rows as a 2-D batch [tokens, features] (transformers passes the flat batch
    as [1, tokens, features]), so a LoRA layer around `inner` finds each adapter's rows by their index."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner(x.reshape(-1, x.shape[-1]))
        return out.reshape(*x.shape[:-1], out.shape[-1])


@dataclass
class Step:
    """The step being run, shared by every layer of one model."""

    meta: AttentionMetadata | None = None


@dataclass
class LayerAttention:
    """One layer's KV cache (given by the model runner) and its sliding window from the config."""

    step: Step
    window: int
    key_cache: torch.Tensor | None = None
    value_cache: torch.Tensor | None = None
    kv_scales: KVScales | None = None  # an fp8 cache's, set with the caches
    calls: int = field(default=0, repr=False)
    sinks: torch.Tensor | None = field(default=None, repr=False)  # a float32 copy of the layer's sinks
    sinks_of: torch.Tensor | None = field(default=None, repr=False)  # the tensor `sinks` was copied from

    def __call__(self, *args) -> torch.Tensor:
        return self.forward(*args)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
                sliding_window: int | None, softcap: float | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """query `[1, Hq, T, D]`, key/value `[1, Hk, T, D]` -> `[1, T, Hq, D]`; `sinks` `[Hq]`: the layer's attention
        sinks, a weight: copied to float32 once (a copy, not a view of the checkpoint's mapped file), again only if
        another tensor comes."""
        self.calls += 1
        if sinks is not None and sinks is not self.sinks_of:
            if sinks.dim() != 1 or sinks.numel() != query.shape[1]:
                raise NotImplementedError(f"its attention sinks have shape {list(sinks.shape)}, where batchgen's "
                                          f"kernels take one per query head ({query.shape[1]})")
            self.sinks, self.sinks_of = sinks.detach().to(torch.float32, copy=True), sinks
        q, k, v = (x[0].transpose(0, 1).contiguous() for x in (query, key, value))
        window = sliding_window if sliding_window is not None else self.window
        variant = AttentionVariant(float(scaling), int(window or 0), float(softcap or 0.0))
        return paged_attention(q, k, v, self.key_cache, self.value_cache, self.step.meta, variant, self.kv_scales,
                               self.sinks if sinks is not None else None)[None]


def batchgen_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: Any, dropout: float = 0.0, scaling: float | None = None,
                       sliding_window: int | None = None, softcap: float | None = None,
                       **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-interface signature over batchgen's paged attention."""
    unsupported = [name for name in _UNSUPPORTED_ARGUMENTS if kwargs.get(name) is not None]
    if unsupported:
        raise NotImplementedError(f"its attention takes {', '.join(unsupported)}, which batchgen's kernels do not have")
    if not getattr(module, "is_causal", True):
        raise NotImplementedError("its attention is not causal")
    if value.shape[-1] != query.shape[-1]:
        raise NotImplementedError("its values have another head size than its queries and keys")
    sinks = next((kwargs[name] for name in _SINK_ARGUMENTS if kwargs.get(name) is not None), None)
    layer: LayerAttention = module.batchgen_layer
    return layer(query, key, value, scaling if scaling is not None else query.shape[-1] ** -0.5, sliding_window,
                 softcap, sinks), None


def register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(BACKEND, batchgen_attention)


def batchgen_experts(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                     top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts-interface signature over the layer's `PackedExperts` (set by `pack_experts`)."""
    return module.batchgen_experts(hidden_states, top_k_index, top_k_weights)


def expert_layers(hf: nn.Module) -> list[nn.Module]:
    """The modules of transformers' experts interface (an MoE layer's experts, with their 3-D weights)."""
    return [m for m in hf.modules() if hasattr(m, "_apply_gate")]  # what transformers' decorator gives them


def pack_experts(hf: nn.Module, int8: bool = False) -> int:
    """The MoE layers' experts (transformers' 3-D expert weights) packed per expert (layers/experts.py), on int8
    compute with `int8`, and run by `batchgen_experts`, their 3-D weights freed one layer at a time; the routers'
    F.linear kept on tall-matrix kernels (`forward_on_min_rows`). Returns the number of expert layers packed; 0
    leaves the model as it was. A token's result then depends on that token alone."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    layers = expert_layers(hf)
    if not layers or not all(_packable_experts(m) for m in layers):
        return 0
    ALL_EXPERTS_FUNCTIONS.register(BACKEND, batchgen_experts)
    for module in hf.modules():
        if "Router" in type(module).__name__ and _owns_matrix(module):
            forward_on_min_rows(module)
    for module in layers:
        module.batchgen_experts = _pack_experts_of(module, int8)
        for name in ("gate_up_proj", "up_proj", "down_proj", "gate_up_proj_bias", "up_proj_bias", "down_proj_bias"):
            if isinstance(getattr(module, name, None), nn.Parameter):
                setattr(module, name, nn.Parameter(torch.empty(0, dtype=getattr(module, name).dtype),
                                                   requires_grad=False))
    hf.set_experts_implementation(BACKEND)
    return len(layers)


def _packable_experts(module: nn.Module) -> bool:
    """Whether an experts module of transformers' experts interface has a layout batchgen packs: 3-D weights on a
    CPU that packs them, not split for expert parallelism."""
    down = getattr(module, "down_proj", None)
    up = getattr(module, "gate_up_proj" if getattr(module, "has_gate", False) else "up_proj", None)
    return (isinstance(down, nn.Parameter) and down.dim() == 3 and isinstance(up, nn.Parameter) and up.dim() == 3
            and can_pack(down) and not getattr(module, "_is_expert_parallel", False))


def _pack_experts_of(module: nn.Module, int8: bool) -> PackedExperts:
    from transformers.integrations.moe import _default_apply_gate

    gated = module.has_gate
    up = module.gate_up_proj if gated else module.up_proj
    fused = (gated and module.is_concatenated and not module.has_bias
             and type(module)._apply_gate is _default_apply_gate
             and type(module.act_fn).__name__ in ("SiLUActivation", "SiLU"))
    return PackedExperts.pack(
        up.detach(), module.down_proj.detach(), transposed=module.is_transposed, fused_silu=fused,
        up_bias=getattr(module, "gate_up_proj_bias" if gated else "up_proj_bias", None) if module.has_bias else None,
        down_bias=module.down_proj_bias if module.has_bias else None,
        gate_fn=module._apply_gate if gated else module.act_fn,
        post_norm=module.post_expert_norm if module.has_post_expert_norm else None, int8=int8)


def _routing_linears(base: nn.Module) -> frozenset[int]:
    """The ids of the linears int8 leaves in the model's dtype: those beside an MoE layer's experts (Qwen2-MoE's
    shared-expert gate) and any named as a router or gate (transformers 4's MoE routers were plain linears named
    `gate`): their few outputs decide which weights run, and int8 would gain nothing on them."""
    experts = {id(m) for m in expert_layers(base)}
    beside = {id(child) for parent in base.modules() if any(id(c) in experts for c in parent.children())
              for child in parent.children()}
    named = {id(m) for name, m in base.named_modules()
             if name.rsplit(".", 1)[-1] in ("gate", "router") or name.endswith("_gate")}
    return frozenset(beside | named)


def _is_activation(module: nn.Module) -> bool:
    """transformers' activation modules (ACT2FN's) and torch's: run through `elementwise.invariant`, so that a
    token's activations do not depend on the step's size (torch's kernels round the last elements of each thread's
    share through a scalar path)."""
    return (type(module).__module__ == "transformers.activations"
            or isinstance(module, (nn.SiLU, nn.GELU, nn.Tanh, nn.Sigmoid, nn.Mish, nn.Softplus)))


def _owns_matrix(module: nn.Module) -> bool:
    """Whether the module holds a 2-D weight of its own that it multiplies itself (an nn.Linear subclass with a
    forward of its own included; a packed one has no Parameter)."""
    weight = getattr(module, "weight", None)
    return isinstance(weight, nn.Parameter) and weight.dim() == 2


class TransformersModel(nn.Module):
    """The runner's seam over a transformers causal LM (or sequence classifier): flat batch in, hidden states
    out; `compute_logits` (`compute_scores` for a classifier)."""

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        self.hf = hf_model
        self.config = text_config(hf_model.config)
        for module in hf_model.modules():
            if _is_activation(module):
                module.forward = functools.partial(invariant, module.forward)
        self.step = Step()
        self.layers = [LayerAttention(self.step, w) for w in layer_windows(hf_model.config)]
        attention_modules = [m for m in hf_model.modules() if type(m).__name__.endswith("Attention")
                             and isinstance(getattr(m, "layer_idx", None), int)]
        for module in attention_modules:
            module.batchgen_layer = self.layers[module.layer_idx]
        if len(attention_modules) != len(self.layers):
            raise NotImplementedError(f"batchgen found {len(attention_modules)} attention layers in its "
                                      f"{len(self.layers)} layers")
        self.class_labels = class_labels(hf_model.config) if is_classifier(hf_model.config) else None
        self.score = hf_model.score if self.class_labels else None
        self.head: nn.Module | None = None if self.class_labels else hf_model.get_output_embeddings()
        self.has_lm_head = self.head is not None
        self.vocab_size = hf_model.get_input_embeddings().num_embeddings
        self.hidden_size = self.config.hidden_size

    def pack_weights(self, quantization: str | None = None) -> None:
        """The projections into batchgen's packed GEMMs, as the native models' (layers/linear.py): several
        times faster on CPU than F.linear, and every row independent of the batch. Left unpacked when the
        model then fails its one-token check (its code reads a projection's weight itself). `quantization`
        "int8": the projections and the experts on int8 compute instead (docs/int8.md), but for the routing
        linears (`_routing_linears`), packed in the model's dtype; a model whose code then fails its one-token
        check is refused."""
        head = self.head
        base = self.hf.base_model
        quantized = quantize_linears(base, (nn.Linear,), _routing_linears(base)) if quantization == "int8" else {}
        packed = pack_linears(base, (nn.Linear,))  # the rest (with int8, the routing linears) in the model's dtype
        for name, plain in packed.items():  # code that reads a projection's dtype or shape (its device is wrong)
            base.get_submodule(name).weight = torch.empty_like(plain.weight, device="meta")
        replaced = quantized | packed
        if head is not None:
            self.head = logits_head(head.weight, head.bias) or head
        try:
            _try_one_token(self)
        except NotImplementedError as e:
            if quantization:
                raise ConfigError([ConfigProblem("quantization", f"{quantization} cannot run "
                                                 f"{architecture(self.hf.config)}: its code reads a projection's "
                                                 f"weight itself, which {quantization} compute replaces ({e})")]
                                  ) from None
            for name, module in replaced.items():
                base.set_submodule(name, module)
            self.head = head
            return
        if head is not None and self.head is not head and head.weight is not self.hf.get_input_embeddings().weight:
            # The packed head replaced it and nothing reads the plain one: kept, own_memory would copy it (an untied
            # head of gpt-oss-20b: 1.2 GB).
            head.weight = nn.Parameter(torch.empty_like(head.weight, device="meta"), requires_grad=False)
        gather_panels(self)  # before the experts: copying theirs too would hold a MoE's weights twice at its peak
        if pack_experts(self.hf, int8=quantization == "int8"):
            try:
                _try_one_token(self)
            except NotImplementedError as e:  # its layout passed _packable_experts: batchgen's bug, not the model's
                raise RuntimeError(f"batchgen's packed experts fail on this model ({e}): a batchgen bug, "
                                   "please report it") from None

    def attention_layers(self) -> list[LayerAttention]:
        return self.layers

    def lora_targets(self) -> Iterator[tuple[nn.Module, str, LoRATarget]]:
        """Every linear of the decoder layers, by the name PEFT gives it (q_proj, dense_h_to_4h, ...), as
        (owner, attribute, target); each is wrapped in `FlatRows` first."""
        base = self.hf.base_model
        for name, module in list(base.named_modules()):
            found = _LORA_PATH.search(name)
            if found is None or not (isinstance(module, PackedLinear) or plain_linear(module)):
                continue
            flat = FlatRows(module)
            base.set_submodule(name, flat)
            yield flat, "inner", LoRATarget(int(found[1]), module.in_features, {found[2]: (0, module.out_features)})

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        self.step.meta = meta
        try:
            out = self.hf.base_model(input_ids=input_ids[None], position_ids=positions[None], use_cache=False)
        finally:
            self.step.meta = None
        return out[0][0]

    def compute_scores(self, hidden: torch.Tensor) -> torch.Tensor:
        """A classifier's logits [n, num_labels] in float32, from its own head."""
        return linear(hidden.float(), self.score.weight.float(),
                      None if self.score.bias is None else self.score.bias.float())

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head, then what transformers' causal LMs do to its logits (scale, soft cap)."""
        if self.head is None:
            raise RuntimeError("this model has no language-model head")
        cfg = self.config
        logits = self.head(hidden)
        if scale := getattr(cfg, "logit_scale", None):  # Cohere
            logits = logits * scale
        if scaling := getattr(cfg, "logits_scaling", None):  # Granite
            logits = logits / scaling
        if cap := getattr(cfg, "final_logit_softcapping", None):  # Gemma 2/3
            logits = invariant(torch.tanh, logits / cap) * cap
        return logits


def load_transformers_model(model_dir: Path, hf_config: Any, dtype: torch.dtype, device: torch.device,
                            quantization: str | None = None) -> TransformersModel:
    """Builds and checks the model; a ConfigError naming the architecture when it cannot run here.
    `quantization`: "int8" or None (TransformersModel.pack_weights)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    register_attention()
    adapted = text_config(hf_config).model_type in ADAPTED_MODEL_TYPES
    auto_class = AutoModelForSequenceClassification if is_classifier(hf_config) else AutoModelForCausalLM
    hf = auto_class.from_pretrained(model_dir, dtype=dtype, device_map={"": str(device)},
                                    attn_implementation="eager" if adapted else BACKEND, **_dequantized(hf_config))
    if adapted:
        adapt_attention(hf, batchgen_attention)
        hf.config._attn_implementation = BACKEND  # no mask: batchgen's attention is causal by block table
    hf.eval().requires_grad_(False)
    try:
        model = TransformersModel(hf)
        _try_one_token(model)
    except NotImplementedError as e:
        message = f"architecture {architecture(hf_config)} cannot run in batchgen: {e}"
        raise ConfigError([ConfigProblem("model", message)]) from None
    model.pack_weights(quantization)
    own_memory(hf)
    return model


def _dequantized(hf_config: Any) -> dict[str, Any]:
    """from_pretrained's arguments that load an MXFP4 checkpoint (GPT-OSS's experts) dequantized to the model's
    dtype. Left to itself transformers keeps MXFP4 wherever Triton and the `kernels` package are installed (they are
    in batchgen's environment) and fetches its kernels from the Hugging Face hub at load; dequantized, the experts are
    dense 3-D weights that batchgen packs like any other MoE's (docs/models.md, GPT-OSS)."""
    config = getattr(hf_config, "quantization_config", None)
    method = config.get("quant_method") if isinstance(config, dict) else getattr(config, "quant_method", None)
    if getattr(method, "value", method) != "mxfp4":  # the config's dict holds a string, a config object an enum
        return {}
    from transformers import Mxfp4Config

    return {"quantization_config": Mxfp4Config(dequantize=True)}


def own_memory(module: nn.Module) -> None:
    """Copies each parameter and buffer left below `module` (embeddings, norms, biases: what packing did not
    replace) into memory of its own. transformers loads tensors as views of the checkpoint's memory-mapped file, and
    one view left keeps the whole mapping, with every page packing read (and wrote), in the process's memory."""
    seen: set[int] = set()
    for tensor in (*module.parameters(), *module.buffers()):
        if id(tensor) not in seen and tensor.device.type == "cpu":
            seen.add(id(tensor))
            tensor.data = tensor.data.clone()


def _try_one_token(model: TransformersModel) -> None:
    """Runs one token through every layer on a scratch cache of one block, so a layer that needs what
    batchgen's attention lacks is refused now, not when the first requests run."""
    geometry = attention_geometry(model.hf.config)
    embeddings = model.hf.get_input_embeddings().weight
    device = embeddings.device
    dtype = model.hf.config.dtype  # the dtype it was loaded in, the engine's cache's: Ergo keeps its embeddings float32
    block_size = ops.SUPPORTED_BLOCK_SIZES[0]
    for layer in model.layers:
        layer.key_cache, layer.value_cache = ops.allocate_kv_cache(
            1, geometry.num_kv_heads, block_size, geometry.head_dim, dtype, device)
    ints = torch.zeros(1, 1, dtype=torch.int32, device=device)
    meta = AttentionMetadata(slot_mapping=torch.zeros(1, dtype=torch.int64, device=device), num_decode_tokens=0,
                             decode_block_tables=None, decode_seq_lens=None, decode_seq_groups=None,
                             prefill_block_tables=ints, prefill_seq_lens=ints[0] + 1,
                             prefill_query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device=device))
    try:
        with torch.inference_mode():
            hidden = model(torch.zeros(1, dtype=torch.long, device=device), ints[0].long(), meta)
            model.compute_logits(hidden) if model.has_lm_head else model.compute_scores(hidden)
    except (RuntimeError, ValueError, AttributeError, TypeError) as e:
        raise NotImplementedError(f"its layers do not fit batchgen's attention ({str(e).splitlines()[0]})") from None
    finally:
        for layer in model.layers:
            layer.key_cache = layer.value_cache = None
    if uncalled := [i for i, layer in enumerate(model.layers) if layer.calls != 1]:
        raise NotImplementedError(f"its layers {uncalled} did not run batchgen's attention once")
    for layer in model.layers:
        layer.calls = 0
