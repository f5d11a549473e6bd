"""LoRA adapters: PEFT checkpoints loaded against a native model, applied per row group in each step.

`request.py` is what users name (kept free of torch so `import batchgen` stays light); `checkpoint.py`
reads and checks a PEFT directory; `layers.py` adds the low-rank terms inside the model's linears;
`manager.py` keeps loaded adapters in host memory and puts them into the model's slots.
"""

from batchgen.lora.request import LoRARequest

__all__ = ["LoRARequest"]
