"""The Llama family (Llama, Mistral, Qwen2, Qwen3, Phi-3) on paged attention.

One class covers the family: Qwen2 adds biases to the q/k/v projections, Qwen3 normalises q and k
per head before the rotary embedding, Phi-3 rotates part of each head and has q/k/v and gate/up
fused in its checkpoint already; Mistral and Phi-3 may attend within a sliding window. q/k/v and
gate/up projections are fused at load time so each layer runs two GEMMs where the checkpoint has five.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from batchgen import ops
from batchgen.layers.attention import AttentionMetadata, PagedAttention
from batchgen.layers.elementwise import invariant
from batchgen.layers.linear import (
    Int8Linear,
    Int8SiluAndMul,
    Linear,
    PackedModule,
    PackedSiluAndMul,
    can_pack,
    gather_panels,
    linear,
    logits_head,
    pack_linears,
    quantize_linears,
    uses_gemm_panels,
)
from batchgen.layers.lora import LoRABatch, LoRATarget, StackedLoRA
from batchgen.layers.rotary import Rope, RotaryEmbedding, rotate


@dataclass
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    qk_norm: bool = False
    sliding_windows: tuple[int, ...] = ()  # per layer (0: none); empty: none anywhere
    rotary_dim: int | None = None  # the leading dims of each head the rotary embedding turns; None: all
    attn_scale: float | None = None  # None: head_dim ** -0.5
    attn_soft_cap: float = 0.0
    class_labels: tuple[str, ...] = ()  # a classifier (...ForSequenceClassification): its head `score`, no LM head

    @property
    def rotated_dims(self) -> int:
        return self.rotary_dim or self.head_dim

    @property
    def scale(self) -> float:
        return self.attn_scale or self.head_dim**-0.5


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); with a residual, adds x to it first (in place) and returns (norm, residual)."""
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps)
        ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
        return x, residual


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig, window: int = 0):
        super().__init__()
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.cfg = cfg
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.attn = PagedAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.scale, window, cfg.attn_soft_cap)

    def forward(self, x: torch.Tensor, rope: Rope, meta: AttentionMetadata) -> torch.Tensor:
        cfg, h = self.cfg, self.cfg.num_heads
        qkv = self.qkv_proj(x)
        qk = qkv[:, : self.q_size + self.kv_size].view(-1, h + cfg.num_kv_heads, cfg.head_dim)  # side by side
        v = qkv[:, self.q_size + self.kv_size :].view(-1, cfg.num_kv_heads, cfg.head_dim)
        if self.q_norm is not None:
            q, k = qk[:, :h], qk[:, h:]
            ops.rms_norm(q, self.q_norm.weight, self.q_norm.eps, out=q)
            ops.rms_norm(k, self.k_norm.weight, self.k_norm.eps, out=k)
        rotate(qk if cfg.rotary_dim is None else qk[..., : cfg.rotary_dim], rope)  # q and k in one pass, in place
        out = self.attn(qk[:, :h], qk[:, h:], v, meta)
        return self.o_proj(out.view(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.packed_gate_up: PackedSiluAndMul | Int8SiluAndMul | None = None  # replaces gate_up_proj once packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_gate_up is not None:
            return self.down_proj(self.packed_gate_up(x))
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(invariant(F.silu, gate) * up)

    def pack(self, quantization: str | None = None) -> None:
        weight = self.gate_up_proj.weight
        if quantization == "int8":
            self.packed_gate_up = Int8SiluAndMul(weight, getattr(self.gate_up_proj, "weight_scale", None))
        elif can_pack(weight):
            self.packed_gate_up = PackedSiluAndMul(weight)
        else:
            return
        del self.gate_up_proj


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, window: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, window)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, rope: Rope, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x is the last sublayer's output, not yet added to the residual stream (vLLM's layout):
        the add is fused into the next norm. The first layer gets the embeddings and no residual."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, rope, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.rotary = RotaryEmbedding(cfg.rotated_dims, cfg.max_position, cfg.rope_theta, cfg.rope_scaling)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        windows = cfg.sliding_windows or (0,) * cfg.num_layers
        self.layers = nn.ModuleList(DecoderLayer(cfg, window) for window in windows)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # A classifier has `score` where a causal LM has its head; a checkpoint saved without its head
        # (some embedding models) has neither: has_lm_head is then False.
        self.has_lm_head = not cfg.class_labels
        self.score = Linear(cfg.hidden_size, len(cfg.class_labels), bias=False) if cfg.class_labels else None
        self.lm_head = (None if cfg.tie_word_embeddings or cfg.class_labels
                        else Linear(cfg.hidden_size, cfg.vocab_size, bias=False))
        self._tied_head: nn.Module | None = None
        self.decoder_stack = None  # the layers in one call, once packed (see _build_decoder_stack)
        self._int8_stack = False  # the stack's projections are int8 (run on every kernel table), not bf16 panels
        self.lora_batch: LoRABatch | None = None  # the step's adapter segments, once attach_lora gave the stack slots

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.cfg.hidden_size

    @property
    def class_labels(self) -> list[str] | None:
        return list(self.cfg.class_labels) or None

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Flat batch in, final hidden states out ([num_tokens, hidden])."""
        return self.decode(self.embed_tokens(input_ids), self.rotary.angles(positions), meta)

    def decode(self, x: torch.Tensor, rope: Rope, meta: AttentionMetadata) -> torch.Tensor:
        """The layers and the final norm over input embeddings `x` ([num_tokens, hidden]) rotated by `rope` (a
        vision-language model brings its own of both: image embeddings at image tokens, M-RoPE angles)."""
        residual, positions = None, rope.positions
        lora = {"lora_segments": self.lora_batch.table()} if self.lora_batch and self.lora_batch.segments else {}
        if self.decoder_stack is not None and (self._int8_stack or ops.has_gemm_bf16()):
            attn = self.attention_layers()
            scales = ({"key_scales": [a.kv_scales.k for a in attn], "value_scales": [a.kv_scales.v for a in attn]}
                      if attn[0].kv_scales is not None else {})  # an fp8 cache's, each layer's
            x, residual = self.decoder_stack.forward(
                x, positions, rope.cos_sin, [a.key_cache for a in attn], [a.value_cache for a in attn],
                meta.slot_mapping, meta.num_decode_tokens, meta.decode_block_tables, meta.decode_seq_lens,
                meta.decode_seq_groups, meta.prefill_block_tables, meta.prefill_seq_lens, meta.prefill_query_start_loc,
                **lora, **scales)
        elif lora:
            raise RuntimeError("this model's LoRA adapters live in its decoder stack, which needs the bf16 GEMM "
                               "that the active CPU kernels lack")
        else:
            for layer in self.layers:
                x, residual = layer(x, residual, rope, meta)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if not self.has_lm_head:
            raise RuntimeError("this model has no language-model head")
        head = self.lm_head if self.lm_head is not None else self._tied_head
        return linear(hidden, self.embed_tokens.weight) if head is None else head(hidden)

    def compute_scores(self, hidden: torch.Tensor) -> torch.Tensor:
        """A classifier's logits [n, num_labels] in float32 (transformers' head has no bias and no activation)."""
        return linear(hidden.float(), self.score.weight.float())

    def pack_weights(self, for_lora: bool = False, quantization: str | None = None) -> None:
        """Packs the projections for the CPU GEMMs (see layers/linear.py), after loading. A head tied
        to the embedding gets a packed copy of its own: the embedding lookup needs the plain one. The
        head's logits come out in float32 where the GEMM can give them so. The GEMM panels then move
        side by side onto huge pages (`gather_panels`). `for_lora`: LoRA adds to gate and up before the
        activation; the decoder stack adds them inside its fused GEMM, but without the stack gate and up stay one
        plain projection for `LoRALinear` and the layers run in Python. `quantization="int8"`: the layers'
        projections run on int8 compute (`Int8Linear`, gate and up as one `Int8SiluAndMul`); the head, the embeddings
        and the norms stay in the model's dtype."""
        if quantization == "int8":
            for layer in self.layers:
                layer.mlp.pack(quantization)
            quantize_linears(self.layers)
        elif not for_lora or self._stack_applies():
            for layer in self.layers:
                layer.mlp.pack()
        pack_linears(self.layers)
        if self.lm_head is not None:
            self.lm_head = logits_head(self.lm_head.weight) or self.lm_head
        elif self.has_lm_head:
            self._tied_head = logits_head(self.embed_tokens.weight)
        gather_panels(self)
        self._build_decoder_stack()

    def _llama_attention(self) -> bool:
        """Whether the attention is the decoder stack's (Llama's: one window everywhere, the rotary embedding on
        whole heads, the default scale, no soft cap)."""
        cfg = self.cfg
        return not (len(set(cfg.sliding_windows or (0,))) > 1 or cfg.rotary_dim or cfg.attn_scale
                    or cfg.attn_soft_cap)

    def _stack_applies(self) -> bool:
        """Before packing: whether `_build_decoder_stack` will build the stack."""
        weights = [p.weight for layer in self.layers for p in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                               layer.mlp.gate_up_proj, layer.mlp.down_proj)]
        return self._llama_attention() and all(uses_gemm_panels(w) for w in weights)

    def attach_lora(self, slots: dict[tuple[int, str], StackedLoRA], batch: LoRABatch) -> None:
        """Hands the decoder stack every layer's adapter slots ((layer, projection) -> StackedLoRA, e.g. (0,
        "qkv_proj")); `forward` then passes it `batch`'s segments, and the stack adds their terms."""
        names = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
        self.decoder_stack.set_lora([[slots[(i, name)].parts() for name in names] for i in range(len(self.layers))])
        self.lora_batch = batch

    def _build_decoder_stack(self) -> None:
        """Where every layer's projections went into batchgen's GEMM panels (bf16 weights, the scalar
        kernels aside) or all run on int8 compute, `forward` runs the layers (Qwen3's q/k norms included) as one
        `ops.DecoderStack` call: the same checked ops in the same order as `DecoderLayer.forward`, so the same
        results bit for bit, without the Python around them (~60 us a layer: ~1.6 ms of a 7.6 ms SmolLM2 decode
        step of 8 sequences). The stack holds the packed weights: packing again means building it again."""
        cfg = self.cfg
        projections = [(layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.packed_gate_up,
                        layer.mlp.down_proj) for layer in self.layers]
        int8 = all(isinstance(p, Int8Linear | Int8SiluAndMul) for ps in projections for p in ps)
        if not (int8 or all(isinstance(p, PackedModule) and p.uses_panels for ps in projections for p in ps)):
            return
        if not self._llama_attention():
            return
        windows = set(cfg.sliding_windows or (0,))
        weights = []
        for layer, (qkv, o, gate_up, down) in zip(self.layers, projections, strict=True):
            if int8:  # gate_up's panels alternate gate's and up's; the stack's up is unused
                gate, up = gate_up.weight.panels, torch.empty(0)
                qkv, o, down = qkv.weight.panels, o.weight.panels, down.weight.panels
            else:
                gate, up = gate_up.gate, gate_up.up
                qkv, o, down = qkv.packed, o.packed, down.packed
            norms = [layer.self_attn.q_norm.weight, layer.self_attn.k_norm.weight] if cfg.qk_norm else []
            weights.append([layer.input_layernorm.weight, qkv, o, layer.post_attention_layernorm.weight, gate, up,
                            down, *norms])
        int8_scales = [[(p.weight.compensation, p.weight.scale) for p in ps] for ps in projections] if int8 else []
        self.decoder_stack = ops.DecoderStack(
            weights, [qkv.bias for qkv, *_ in projections], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.hidden_size, cfg.intermediate_size, cfg.rms_norm_eps, cfg.head_dim**-0.5,
            **({"sliding_window": window} if (window := windows.pop()) else {}), int8=int8_scales)
        self._int8_stack = int8

    def _fused_pieces(self) -> dict[str, tuple[str, int, int]]:
        """Checkpoint projection -> (the fused projection holding it, first output row, rows)."""
        cfg = self.cfg
        q, kv, ffn = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
        return {"q_proj": ("qkv_proj", 0, q), "k_proj": ("qkv_proj", q, kv), "v_proj": ("qkv_proj", q + kv, kv),
                "gate_proj": ("gate_up_proj", 0, ffn), "up_proj": ("gate_up_proj", ffn, ffn)}

    def lora_targets(self) -> Iterator[tuple[nn.Module, str, LoRATarget]]:
        """Every projection a LoRA adapter may add to, as (owner, attribute, target); a fused one answers to
        its parts' checkpoint names and its own. Needs `pack_weights(for_lora=True)` (gate/up unfused where the
        layers run in Python)."""
        cfg, pieces = self.cfg, self._fused_pieces()
        q, ffn = cfg.num_heads * cfg.head_dim, cfg.intermediate_size
        for i, layer in enumerate(self.layers):
            attn, mlp = layer.self_attn, layer.mlp
            if mlp.packed_gate_up is not None and self.decoder_stack is None:
                raise RuntimeError("LoRA needs the model packed with pack_weights(for_lora=True)")
            for owner, fused, width in ((attn, "qkv_proj", cfg.hidden_size), (mlp, "gate_up_proj", cfg.hidden_size)):
                parts = {name: (first, rows) for name, (target, first, rows) in pieces.items() if target == fused}
                whole = max(first + rows for first, rows in parts.values())
                yield owner, fused, LoRATarget(i, width, parts | {fused: (0, whole)})
            yield attn, "o_proj", LoRATarget(i, q, {"o_proj": (0, cfg.hidden_size)})
            yield mlp, "down_proj", LoRATarget(i, ffn, {"down_proj": (0, cfg.hidden_size)})

    def native_name(self, name: str) -> tuple[str, slice | None]:
        """A checkpoint tensor's (or module's) name, less "model.", as the model's, and the rows it fills of a
        fused projection (None: all of it)."""
        parts = name.removeprefix("model.").split(".")
        if len(parts) >= 2 and parts[-2] in (pieces := self._fused_pieces()):
            target, first, rows = pieces[parts[-2]]
            return ".".join([*parts[:-2], target, parts[-1]]), slice(first, first + rows)
        return ".".join(parts), None

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Takes Hugging Face checkpoint names; fuses q/k/v and gate/up on the way in."""
        params = dict(self.named_parameters())
        pieces = self._fused_pieces()
        expected = {n for n in params if n.split(".")[-2] not in ("qkv_proj", "gate_up_proj")}
        for n in params:
            module = n.split(".")[-2]
            expected |= {f"{n}@{first}" for target, first, _ in pieces.values() if target == module}
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name or (name == "lm_head.weight" and self.lm_head is None):
                continue
            if name.startswith("score.") and self.score is None:
                raise ValueError(f"checkpoint tensor {name!r} is a classification head, but its config names "
                                 "a causal LM architecture")
            parts = name.split(".")
            if parts[0] == "layers" and parts[-2:] in (["self_attn", "k_scale"], ["self_attn", "v_scale"]):
                self.layers[int(parts[1])].self_attn.attn.checkpoint_kv_scales[parts[-1]] = tensor  # fp8 KV
                continue
            name, rows = self.native_name(name)
            if rows is not None:
                params[name][rows].copy_(tensor)
                loaded.add(f"{name}@{rows.start}")
            elif name in params:
                params[name].copy_(tensor)
                loaded.add(name)
                if parts[-2] in ("qkv_proj", "gate_up_proj"):  # fused in the checkpoint already (Phi-3)
                    loaded |= {f"{name}@{first}" for target, first, _ in pieces.values() if target == parts[-2]}
            else:
                raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
        if self.lm_head is not None and expected - loaded == {"lm_head.weight"}:
            self.lm_head, self.has_lm_head = None, False  # saved without its head: it embeds, it cannot generate
            loaded.add("lm_head.weight")
        if missing := sorted(expected - loaded):
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")
