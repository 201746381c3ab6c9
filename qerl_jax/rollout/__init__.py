"""The rollout engine: KV-cache generation on the (quantized) policy."""
