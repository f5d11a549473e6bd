"""Integrations with the tools people already run: each sits on the public `LLM` API (or the job runner), and
nothing below them knows they exist. `lm_eval`: batchgen as an lm-evaluation-harness backend."""
