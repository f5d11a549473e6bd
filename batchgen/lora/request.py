"""LoRARequest: which adapter a request runs with (vLLM's name and fields)."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter directory as PEFT saves it (`adapter_config.json` with `adapter_model.safetensors` or
    `.bin`). `lora_int_id` (>= 1) is its identity in the engine: two requests with the same id share one
    loaded copy, its device slot and its prefix-cache blocks, so one id must always name one adapter."""

    lora_name: str
    lora_int_id: int
    lora_path: str | os.PathLike[str]

    def __post_init__(self) -> None:
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id: must be an integer >= 1 (got {self.lora_int_id!r})")
        if not self.lora_name:
            raise ValueError("lora_name: must not be empty")
