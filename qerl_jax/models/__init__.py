"""Model definitions."""

from qerl_jax.models.qwen2 import PROJECTIONS, ForwardOptions, ModelConfig, Qwen2, forward, positions_from_mask

__all__ = ["PROJECTIONS", "ForwardOptions", "ModelConfig", "Qwen2", "forward", "positions_from_mask"]
