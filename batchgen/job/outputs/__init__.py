"""The output side of a job: parts written whole and create-only (``writer``), their layouts
(``formats``: parquet, jsonl, openai_batch), the OpenAI batch response shape, the saved job
configuration, and ``merge`` into one file. Every file goes through ``batchgen.storage``."""
