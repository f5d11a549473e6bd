"""batchgen: offline batch generation on a paged KV cache.

`LLM` is imported on first use, so that `import batchgen` (the CLI, the job tools) stays light.
"""

from batchgen.lora.request import LoRARequest
from batchgen.outputs import BeamSearchOutput, BeamSearchSequence, CompletionOutput, Logprob, RequestOutput
from batchgen.sampling_params import BeamSearchParams, SamplingParams
from batchgen.structured import StructuredOutputsParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "BeamSearchParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput",
           "BeamSearchOutput", "BeamSearchSequence", "LoRARequest", "Logprob", "__version__"]


def __getattr__(name: str):
    if name == "LLM":
        from batchgen.llm import LLM

        return LLM
    raise AttributeError(f"module 'batchgen' has no attribute {name!r}")
