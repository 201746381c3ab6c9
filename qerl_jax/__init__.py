"""qerl-jax: QeRL (quantization-enhanced RL for LLMs) in JAX.

Public API:
  config, params = qerl_jax.load_model(path, dtype="bfloat16", quant=None)
  logits = qerl_jax.forward(config, params, input_ids, attention_mask)
"""

from qerl_jax.model_io.loader import load_model, load_tokenizer
from qerl_jax.models.qwen2 import ModelConfig, forward

__all__ = ["ModelConfig", "forward", "load_model", "load_tokenizer"]
__version__ = "0.1.0"
