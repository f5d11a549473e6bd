"""Vision-language models: image preprocessing (on the prompt reader's thread), vision towers and the
placement of their embeddings at a prompt's image tokens, over batchgen's paged decoders."""
