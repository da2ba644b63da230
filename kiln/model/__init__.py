"""Step 4, the model: the families (GPT-2, Llama, mixture of experts; kiln.model.families), the fused output loss,
LoRA and QLoRA, generation with a KV cache, and the parallelism wrappers (FSDP2, tensor, pipeline and expert
parallelism)."""
