"""LoRAManager: the adapters loaded in host memory, and the model's LoRA layers whose `max_loras` slots hold
the resident ones. Which adapter sits in which slot is the scheduler's decision (engine/adapter_slots.py);
the runner asks this to put it there before the step that needs it.

Host memory holds at most `max_cpu_loras` adapters (None: every one named): beyond it the least recently
named or loaded one that sits in no device slot is dropped, and read from its directory again when it is
next put into a slot. An adapter in a slot is never dropped (there are at most max_loras <= max_cpu_loras).

A model with batchgen's C++ decoder stack (`decoder_stack`) gets its slots as `StackedLoRA`s, which the stack
reads inside its GEMMs (`attach_lora`); any other model gets `LoRALinear`s in place of its projections (on
CUDA each holding a float32 `StackedLoRA` for the segmented kernel)."""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from batchgen.layers.lora import LoRABatch, LoRALinear, StackedLoRA
from batchgen.lora.checkpoint import Adapter, AdapterError, load_adapter
from batchgen.lora.request import LoRARequest


class LoRAManager:
    def __init__(self, model: nn.Module, max_loras: int, max_lora_rank: int, dtype: torch.dtype,
                 device: torch.device, max_cpu_loras: int | None = None):
        self.max_loras, self.max_lora_rank, self.dtype, self.device = max_loras, max_lora_rank, dtype, device
        self.max_cpu_loras = max_cpu_loras
        self.batch = LoRABatch()
        self.layers: list[LoRALinear | StackedLoRA] = []
        self.shapes: dict[tuple[int, str], tuple[int, int]] = {}
        stacked: dict[tuple[int, str], StackedLoRA] = {}
        in_stack = getattr(model, "decoder_stack", None) is not None
        for owner, attr, target in model.lora_targets():
            if in_stack:
                layer = stacked[(target.layer, attr)] = StackedLoRA(target, max_loras, max_lora_rank, dtype)
            else:
                kernel = StackedLoRA(target, max_loras, max_lora_rank, device=device) if device.type == "cuda" else None
                layer = LoRALinear(getattr(owner, attr), target, self.batch, max_loras, kernel)
                setattr(owner, attr, layer)
            self.layers.append(layer)
            self.shapes |= {(target.layer, name): (target.in_features, rows)
                            for name, (_, rows) in target.parts.items()}
        if in_stack:
            model.attach_lora(stacked, self.batch)
        self.requests: dict[int, LoRARequest] = {}  # by lora_int_id: every adapter a request has named
        self.adapters: OrderedDict[int, Adapter] = OrderedDict()  # those in host memory, least recently used first
        self.in_slot: list[int | None] = [None] * max_loras
        self.num_reads = 0  # adapters read from their directories (a dropped one read again counts again)

    def register(self, request: LoRARequest) -> None:
        """Loads and checks the adapter the first time its id is named (AdapterError: one line why not)."""
        known = self.requests.get(request.lora_int_id)
        if known is not None:
            if (known.lora_name, str(known.lora_path)) != (request.lora_name, str(request.lora_path)):
                raise AdapterError(f"lora_request: lora_int_id {request.lora_int_id} names adapter "
                                   f"{known.lora_name!r} ({known.lora_path}) already; give "
                                   f"{request.lora_name!r} ({request.lora_path}) an id of its own")
            if request.lora_int_id in self.adapters:
                self.adapters.move_to_end(request.lora_int_id)
            return
        self._keep(request.lora_int_id, self._read(request))
        self.requests[request.lora_int_id] = request

    def load(self, slot: int, lora_id: int) -> None:
        """Puts adapter `lora_id` (registered) into device slot `slot`, replacing what was there; a dropped
        adapter is read from its directory again first."""
        self.in_slot[slot] = lora_id
        adapter = self.adapters.get(lora_id)
        if adapter is None:
            adapter = self._read(self.requests[lora_id])
        self._keep(lora_id, adapter)
        for layer in self.layers:
            layer.load(slot, adapter, self.device)

    def _read(self, request: LoRARequest) -> Adapter:
        adapter = load_adapter(request, self.shapes, self.dtype)
        if adapter.rank > self.max_lora_rank:
            raise AdapterError(f"lora_request: adapter {request.lora_name!r} ({request.lora_path}) has rank "
                               f"{adapter.rank}, more than max_lora_rank {self.max_lora_rank}; raise max_lora_rank")
        self.num_reads += 1
        return adapter

    def _keep(self, lora_id: int, adapter: Adapter) -> None:
        """`adapter` kept as the most recently used; the least recently used beyond max_cpu_loras dropped,
        never one in a device slot."""
        self.adapters[lora_id] = adapter
        self.adapters.move_to_end(lora_id)
        if self.max_cpu_loras is None:
            return
        idle = [other for other in self.adapters if other not in self.in_slot and other != lora_id]
        for other in idle[:max(0, len(self.adapters) - self.max_cpu_loras)]:
            del self.adapters[other]
