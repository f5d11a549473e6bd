"""batchgen: offline batch generation on a paged KV cache."""

__version__ = "0.1.0"
