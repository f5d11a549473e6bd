"""Structured outputs: constraints on what a sample may generate (JSON schema, regex, choice, grammar).

``params`` holds the user-facing ``StructuredOutputsParams``; ``backend`` is the engine's xgrammar
glue (compile cache, one matcher per sample, token bitmasks). xgrammar is imported on first use.
"""

from batchgen.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
