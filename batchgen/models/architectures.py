"""What batchgen reads from a model's config before building anything: which implementation runs it
(batchgen's native one, or the model's own transformers code on batchgen's paged attention), or why
neither can; the attention geometry the KV cache is shaped by; each layer's sliding window."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from batchgen.layers.rotary import ROPE_TYPES

# Architectures with a native implementation in batchgen/models/, by the module that has it.
NATIVE_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "Qwen3ForCausalLM": "llama",
    "Phi3ForCausalLM": "llama",
    "Gemma2ForCausalLM": "gemma",
    "Gemma3ForCausalLM": "gemma",
    # vision-language models: a native decoder under the family's vision part (models/vision/)
    "LlavaForConditionalGeneration": "vision",
    "Qwen2VLForConditionalGeneration": "vision",
    "Qwen2_5_VLForConditionalGeneration": "vision",
    "Idefics3ForConditionalGeneration": "vision",
    "SmolVLMForConditionalGeneration": "vision",
    "Mistral3ForConditionalGeneration": "vision",
    "Gemma3ForConditionalGeneration": "vision",
    # ... and the generic path's: transformers' own model on the transformers backend (models/vision/generic.py)
    "LlavaNextForConditionalGeneration": "vision",
    "AyaVisionForConditionalGeneration": "vision",
}
# A vision-language model's language model (its text config's model type) -> the native decoder that runs it.
VISION_DECODERS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                   "qwen3": "Qwen3ForCausalLM", "qwen2_vl_text": "Qwen2ForCausalLM",
                   "qwen2_5_vl_text": "Qwen2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}
# Vision-language families run by transformers' own model API (get_image_features, the processor's placeholder
# expansion), their language model always on the transformers backend (models/vision/generic.py).
GENERIC_VISION_FAMILIES = {"llava_next", "aya_vision"}
# Families whose vision part also runs over a language model of the transformers backend (models/vision/backend.py).
BACKEND_VISION_FAMILIES = {"llava"} | GENERIC_VISION_FAMILIES
# Vision-language families that do not fit: their images do not enter as embeddings at image tokens of a causal
# decoder with 1-D positions (M-RoPE models are found by `is_mrope`).
VISION_MISFITS = {
    "paligemma": "its image and prompt tokens attend to each other both ways (a bidirectional prefix), which "
                 "batchgen's causal paged attention does not do",
    "mllama": "its images enter through cross-attention layers of the language model, not as embeddings at image "
              "tokens",
}
# Layers with a state instead of attention over a KV cache.
RECURRENT_MODEL_TYPES = {
    "mamba", "mamba2", "falcon_mamba", "falcon_h1", "rwkv", "recurrent_gemma", "jamba", "zamba", "zamba2",
    "bamba", "nemotron_h", "granitemoehybrid", "lfm2", "lfm2_moe", "xlstm", "qwen3_next", "minimax", "plamo2",
}
ALIBI_MODEL_TYPES = {"bloom", "mpt", "baichuan"}
ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention"}
# transformers implementations whose attention does not go through its attention interface, and that
# batchgen/models/transformers_adapters.py plugs into batchgen's attention itself.
ADAPTED_MODEL_TYPES = {"falcon"}


CLASSIFIER_SUFFIX = "ForSequenceClassification"


def architecture(hf_config: Any) -> str:
    archs = getattr(hf_config, "architectures", None) or []
    return archs[0] if archs else f"{type(hf_config).__name__} (config.json names no architecture)"


def is_classifier(hf_config: Any) -> bool:
    """A checkpoint with a sequence-classification head (classifiers, reward models) in place of the LM head."""
    return architecture(hf_config).endswith(CLASSIFIER_SUFFIX)


def decoder_architecture(hf_config: Any) -> str:
    """The causal LM whose decoder a checkpoint has: `XForSequenceClassification` runs X's decoder, and so
    does a bare `XModel` (embedding models such as e5-mistral) where X has a native implementation."""
    arch = architecture(hf_config)
    if is_classifier(hf_config):
        return arch.removesuffix(CLASSIFIER_SUFFIX) + "ForCausalLM"
    bare = arch.removesuffix("Model") + "ForCausalLM"
    return bare if arch.endswith("Model") and bare in NATIVE_ARCHITECTURES else arch


def class_labels(hf_config: Any) -> list[str]:
    """A classifier's label names in class order, from the config's id2label (LABEL_i where it has none)."""
    id2label = {int(k): v for k, v in (getattr(hf_config, "id2label", None) or {}).items()}
    return [id2label.get(i, f"LABEL_{i}") for i in range(hf_config.num_labels)]


def pick_impl(asked: str, hf_config: Any) -> str:
    """"native" or "transformers" for `model_impl` `asked`; a one-line ValueError when neither can run it.
    Its first word is the option at fault: "model_impl" or "model"."""
    arch = decoder_architecture(hf_config)
    native_misfit = native_refusal(hf_config) if arch in NATIVE_ARCHITECTURES else None
    if asked == "native":
        if arch not in NATIVE_ARCHITECTURES:
            raise ValueError(f"model_impl: batchgen has no native implementation of {arch} (native: "
                             f"{', '.join(NATIVE_ARCHITECTURES)}); use model_impl auto or transformers")
        if native_misfit:
            raise ValueError(f"model_impl: batchgen's native {arch} cannot run this model: {native_misfit}; "
                             "use model_impl auto or transformers")
        return "native"
    if asked == "auto" and arch in NATIVE_ARCHITECTURES and not native_misfit:
        return "native"
    if why := transformers_refusal(hf_config):
        raise ValueError(f"model: architecture {arch} cannot run in batchgen: {why}")
    return "transformers"


def native_refusal(hf_config: Any) -> str | None:
    """Why a native family cannot run this member of it (transformers then can), or None."""
    if why := vision_refusal(hf_config):
        return why
    for layer_type in set(getattr(text_config(hf_config), "layer_types", None) or [None]):
        scaling = rope(hf_config, layer_type)[1] or {}
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            return f"its rope scaling {rope_type!r} (native: {', '.join(ROPE_TYPES)})"
    return None


def rope(hf_config: Any, layer_type: str | None = None) -> tuple[float, dict | None]:
    """rope theta and scaling (None: plain), from transformers 5's `rope_parameters` (one per layer type
    for Gemma 3) or the older fields."""
    cfg = text_config(hf_config)
    params = getattr(cfg, "rope_parameters", None)
    if isinstance(params, dict) and layer_type in params:
        params = params[layer_type]
    if isinstance(params, dict) and "rope_theta" in params:
        scaling = None if params.get("rope_type", "default") == "default" else params
        return float(params["rope_theta"]), scaling
    return float(getattr(cfg, "rope_theta", 10000.0)), getattr(cfg, "rope_scaling", None)


def vision_refusal(hf_config: Any) -> str | None:
    """Why a vision-language model's language model has no native decoder (None: it has one, or no vision)."""
    if NATIVE_ARCHITECTURES.get(decoder_architecture(hf_config)) != "vision":
        return None
    text_type = text_config(hf_config).model_type
    if getattr(hf_config, "model_type", "") in GENERIC_VISION_FAMILIES:
        backend_why = transformers_refusal(text_config(hf_config))
        return None if backend_why is None else (f"its language model {text_type!r} cannot run on the transformers "
                                                 f"backend: {backend_why}")
    if text_type in VISION_DECODERS:
        return None
    why = f"its language model {text_type!r} has no native decoder in batchgen (native: {', '.join(VISION_DECODERS)})"
    if getattr(hf_config, "model_type", "") not in BACKEND_VISION_FAMILIES:
        return why
    backend_why = transformers_refusal(text_config(hf_config))
    return None if backend_why is None else f"{why}, and the transformers backend cannot run it: {backend_why}"


def transformers_refusal(hf_config: Any) -> str | None:
    """Why the transformers backend cannot run this model on batchgen's paged attention, or None."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    if NATIVE_ARCHITECTURES.get(decoder_architecture(hf_config)) == "vision":
        why = vision_refusal(hf_config)
        return (f"{why + '; ' if why else ''}vision-language models run on batchgen's native decoders, and LLaVA "
                f"and {', '.join(sorted(GENERIC_VISION_FAMILIES))} on a language model of the transformers backend, "
                "with model_impl auto (docs/vision.md)")

    model_type = getattr(hf_config, "model_type", "")
    archs = getattr(hf_config, "architectures", None) or []
    auto_class = AutoModelForSequenceClassification if is_classifier(hf_config) else AutoModelForCausalLM
    layer_types = set(getattr(hf_config, "layer_types", None) or ()) - ATTENTION_LAYER_TYPES
    if getattr(hf_config, "is_encoder_decoder", False):
        return "it is an encoder-decoder model; batchgen runs decoder-only models"
    if model_type in RECURRENT_MODEL_TYPES or layer_types:
        kinds = ", ".join(sorted(layer_types)) or "recurrent/state-space"
        return f"it has {kinds} layers, which keep a state instead of a KV cache"
    if archs and not any(a.endswith(("ForCausalLM", "LMHeadModel", CLASSIFIER_SUFFIX)) for a in archs):
        if getattr(hf_config, "vision_config", None) is not None:  # a vision-language model batchgen does not list
            return vision_misfit(hf_config)
        return ("it has neither a causal language-model head (...ForCausalLM) nor a classification head "
                f"(...{CLASSIFIER_SUFFIX})")
    if type(hf_config) not in auto_class._model_mapping:
        kind = "sequence classifier" if auto_class is AutoModelForSequenceClassification else "causal language model"
        return f"transformers has no {kind} for model type {model_type!r}"
    if getattr(hf_config, "add_cross_attention", False):
        return "it has cross-attention layers"
    if model_type in ALIBI_MODEL_TYPES or getattr(hf_config, "alibi", False):
        return "it uses ALiBi position biases, which batchgen's attention kernels do not have"
    if getattr(hf_config, "attention_chunk_size", None):
        return "it uses chunked attention, which batchgen's attention kernels do not have"
    if getattr(hf_config, "kv_lora_rank", None):
        return "it uses multi-head latent attention, which batchgen's attention kernels do not have"
    model_class = auto_class._model_mapping[type(hf_config)]
    if not getattr(model_class, "_supports_attention_backend", False) and model_type not in ADAPTED_MODEL_TYPES:
        return "its transformers code does not call attention through transformers' attention interface"
    return None


def vision_misfit(hf_config: Any) -> str:
    """Why a vision-language family batchgen does not list cannot run: its images' way into the language model, or
    that the generic path has not been checked on it."""
    model_type = getattr(hf_config, "model_type", "")
    if model_type in VISION_MISFITS:
        return VISION_MISFITS[model_type]
    if is_mrope(hf_config):
        return ("its language model's positions are 3-D (M-RoPE), which batchgen runs natively for Qwen2-VL and "
                "Qwen2.5-VL only")
    return (f"its vision-language family {model_type!r} is not one batchgen runs (natively, or by transformers' own "
            f"model API: {', '.join(sorted(GENERIC_VISION_FAMILIES))}; docs/vision.md)")


def is_mrope(hf_config: Any) -> bool:
    """Whether a vision-language model's positions are M-RoPE's 3-D ones: its rope parameters' `mrope_section`, or
    (configs that leave it to the checkpoint) its transformers model computing them (`get_rope_index`)."""
    from transformers import AutoModel

    text = text_config(hf_config)
    params = [getattr(text, "rope_parameters", None), getattr(text, "rope_scaling", None)]
    if any(isinstance(p, dict) and "mrope_section" in p for p in params):
        return True
    return type(hf_config) in AutoModel._model_mapping and hasattr(AutoModel._model_mapping[type(hf_config)],
                                                                   "get_rope_index")


@dataclass(frozen=True)
class AttentionGeometry:
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int


def text_config(hf_config: Any) -> Any:
    return hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config


def attention_geometry(hf_config: Any) -> AttentionGeometry:
    cfg = text_config(hf_config)
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    if cfg.model_type == "falcon":  # its own names, and one KV head for all with multi_query
        kv_heads = cfg.num_kv_heads if cfg.new_decoder_architecture else 1 if cfg.multi_query else heads
    return AttentionGeometry(cfg.num_hidden_layers, heads, kv_heads, head_dim)


def layer_windows(hf_config: Any) -> list[int]:
    """Each layer's sliding window (0: none), as transformers' layers read it: `layer_types` names the
    sliding layers where the config has it, else a `sliding_window` holds for every layer."""
    cfg = text_config(hf_config)
    window = getattr(cfg, "sliding_window", None) or 0
    if not getattr(cfg, "use_sliding_window", True):
        window = 0
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is None:
        return [window] * cfg.num_hidden_layers
    return [window if kind == "sliding_attention" else 0 for kind in layer_types]
