"""qerl-jax: QeRL (quantization-enhanced RL for LLMs) in JAX.

Public API:
  config, params = qerl_jax.load_model(path, dtype="bfloat16", quant=None)
  logits = qerl_jax.forward(config, params, input_ids, attention_mask)
"""

import logging

__all__ = ["ModelConfig", "forward", "load_model", "load_tokenizer"]
__version__ = "0.1.0"


def _no_torch_notice(record: logging.LogRecord) -> bool:
    # transformers announces at import that it found no PyTorch; we use only its tokenizers and configs,
    # so on a machine without torch that line is noise a user reads as a problem.
    return not str(record.msg).startswith("PyTorch was not found")


logging.getLogger("transformers").addFilter(_no_torch_notice)


def __getattr__(name: str):
    # The public API is imported on first use, not with the package: every module of the package
    # imports it first, and a reward worker (`reward_pool`) must not pay for JAX and the model code.
    if name in ("load_model", "load_tokenizer"):
        from qerl_jax.model_io import loader  # noqa: PLC0415

        return getattr(loader, name)
    if name in ("ModelConfig", "forward"):
        from qerl_jax.models import qwen2  # noqa: PLC0415

        return getattr(qwen2, name)
    raise AttributeError(f"module 'qerl_jax' has no attribute {name!r}")
