"""LoRAManager: the adapters loaded in host memory, and the model's LoRA layers whose `max_loras` slots hold
the resident ones. Which adapter sits in which slot is the scheduler's decision (engine/adapter_slots.py);
the runner asks this to put it there before the step that needs it.

A model with batchgen's C++ decoder stack (`decoder_stack`) gets its slots as `StackedLoRA`s, which the stack
reads inside its GEMMs (`attach_lora`); any other model gets `LoRALinear`s in place of its projections."""

from __future__ import annotations

import torch
from torch import nn

from batchgen.lora.checkpoint import Adapter, AdapterError, load_adapter
from batchgen.lora.layers import LoRABatch, LoRALinear, StackedLoRA
from batchgen.lora.request import LoRARequest


class LoRAManager:
    def __init__(self, model: nn.Module, max_loras: int, max_lora_rank: int, dtype: torch.dtype,
                 device: torch.device):
        self.max_loras, self.max_lora_rank, self.dtype, self.device = max_loras, max_lora_rank, dtype, device
        self.batch = LoRABatch()
        self.layers: list[LoRALinear | StackedLoRA] = []
        self.shapes: dict[tuple[int, str], tuple[int, int]] = {}
        stacked: dict[tuple[int, str], StackedLoRA] = {}
        in_stack = getattr(model, "decoder_stack", None) is not None
        for owner, attr, target in model.lora_targets():
            if in_stack:
                layer = stacked[(target.layer, attr)] = StackedLoRA(target, max_loras, max_lora_rank)
            else:
                layer = LoRALinear(getattr(owner, attr), target, self.batch, max_loras)
                setattr(owner, attr, layer)
            self.layers.append(layer)
            self.shapes |= {(target.layer, name): (target.in_features, rows)
                            for name, (_, rows) in target.parts.items()}
        if in_stack:
            model.attach_lora(stacked, self.batch)
        self.adapters: dict[int, Adapter] = {}  # by lora_int_id: every adapter a request has named

    def register(self, request: LoRARequest) -> None:
        """Loads and checks the adapter the first time its id is named (AdapterError: one line why not)."""
        known = self.adapters.get(request.lora_int_id)
        if known is not None:
            if (known.request.lora_name, str(known.request.lora_path)) != (request.lora_name, str(request.lora_path)):
                raise AdapterError(f"lora_request: lora_int_id {request.lora_int_id} names adapter "
                                   f"{known.request.lora_name!r} ({known.request.lora_path}) already; give "
                                   f"{request.lora_name!r} ({request.lora_path}) an id of its own")
            return
        adapter = load_adapter(request, self.shapes, self.dtype)
        if adapter.rank > self.max_lora_rank:
            raise AdapterError(f"lora_request: adapter {request.lora_name!r} ({request.lora_path}) has rank "
                               f"{adapter.rank}, more than max_lora_rank {self.max_lora_rank}; raise max_lora_rank")
        self.adapters[request.lora_int_id] = adapter

    def load(self, slot: int, lora_id: int) -> None:
        """Puts adapter `lora_id` (registered) into device slot `slot`, replacing what was there."""
        adapter = self.adapters[lora_id]
        for layer in self.layers:
            layer.load(slot, adapter, self.device)
