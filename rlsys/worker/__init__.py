"""Training-side building blocks of the Megatron workers (batching, packing)."""
