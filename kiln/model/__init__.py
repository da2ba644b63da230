"""Step 4, the model: the GPT family, its fused output loss, LoRA and the parallelism wrappers."""
