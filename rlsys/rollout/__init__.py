"""Rollout engines (SGLang over HTTP, a CPU engine on transformers) and the protocol they share."""
