"""Weight resharding: trainer shards -> HF-named full tensors -> buckets -> rollout engines."""
