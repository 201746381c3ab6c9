"""Adaptive Quantization Noise (AQN, QeRL section 3.3): channel-wise Gaussian noise in the RMSNorm scales.

For the rollout policy of step t every RMSNorm scale vector w (input_layernorm [L, D],
post_attention_layernorm [L, D], final_norm [D]) becomes w + z with z ~ N(0, sigma_t^2)
drawn per channel, independently per layer and per norm, fresh each step from
`fold_in(key, t)` and always added to the *clean* scales (noise never accumulates). Since
RMSNorm is y = w * x_hat, (w + z) * x_hat feeds the next projection W as x_hat @ (W diag(w + z)).T:
a per-input-channel multiplicative perturbation of q/k/v and gate/up, at zero parameter cost.

Schedule: the run's `total_steps` are split into K = num_stages equal stages,
stage(t) = min(floor(min(t, total_steps) * K / total_steps), K - 1). Stage 0 adds no noise (the
quantization noise alone explores); stage j = 1..K-1 uses sigma_j = f(u), u = (j - 1) / (K - 2)
(u = 0 when K = 2), with s0 = sigma_start, s1 = sigma_end. With first_stage_noise every stage
j = 0..K-1 adds noise, u = j / (K - 1) (a schedule whose first stage already explores with noise,
as the dose-response experiment needs):

  exponential: s0 * (s1 / s0) ** u                     (the paper's default, eq. 8)
  linear:      s0 + (s1 - s0) * u
  cosine:      s1 + (s0 - s1) * (1 + cos(pi * u)) / 2
  logarithmic: s0 - (s0 - s1) * log10(1 + 9 u)         (fast early decay, then flat)

All four equal s0 at the first noise stage and s1 at stage K - 1. Noise perturbs sampling only: the
train-time forward uses the clean norms, so the gradient is that of the clean LoRA policy; the
loop applies AQN to the rollout's norms only.

Precision note: the model applies the scale in the activation dtype, so with bf16 norms a
noise much smaller than half a bf16 ulp of w (~2e-3 for w near 1) is rounded away, as in the
reference (which adds bf16 noise to bf16 norm weights in place).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qerl_jax.quant.formats import CONFIG_FORMATS, DENSE, FORMATS

DECAYS = ("exponential", "linear", "cosine", "logarithmic")


@dataclasses.dataclass(frozen=True)
class AQNConfig:
    """AQN settings. total_steps is the run's number of train steps (required when enabled)."""

    enabled: bool = False
    sigma_start: float = 1e-2
    sigma_end: float = 1e-4
    num_stages: int = 10
    decay: str = "exponential"
    total_steps: int | None = None
    first_stage_noise: bool = False

    def __post_init__(self):
        if self.decay not in DECAYS:
            raise ValueError(f"AQNConfig.decay {self.decay!r} is unknown; expected one of {DECAYS}")
        if not self.enabled:
            return
        if not isinstance(self.total_steps, int) or self.total_steps < 1:
            raise ValueError(
                f"AQNConfig.total_steps must be a positive int when AQN is enabled; got {self.total_steps!r}"
            )
        if not isinstance(self.num_stages, int) or self.num_stages < 2:
            raise ValueError(
                f"AQNConfig.num_stages must be an int >= 2 (stage 0 is noise-free); got {self.num_stages!r}"
            )
        if not (self.sigma_start > 0 and self.sigma_end >= 0):
            raise ValueError(
                f"AQNConfig needs sigma_start > 0 and sigma_end >= 0; got {self.sigma_start}, {self.sigma_end}"
            )
        if self.decay == "exponential" and self.sigma_end <= 0:
            raise ValueError("AQNConfig.decay='exponential' needs sigma_end > 0")


def default_aqn_enabled(quant_fmt: str) -> bool:
    """AQN is on by default for 4-bit policies and off for dense ("bf16") ones."""
    if quant_fmt == DENSE:
        return False
    if quant_fmt in FORMATS:
        return True
    raise ValueError(f"quantization format {quant_fmt!r} is unknown; expected one of {CONFIG_FORMATS}")


def stage_sigmas(cfg: AQNConfig) -> tuple[float, ...]:
    """sigma of each stage 0..K-1 (stage 0 is 0.0 unless first_stage_noise), as Python floats."""
    k = cfg.num_stages
    s0, s1 = float(cfg.sigma_start), float(cfg.sigma_end)
    first = 0 if cfg.first_stage_noise else 1
    out = [] if cfg.first_stage_noise else [0.0]
    for j in range(first, k):
        u = (j - first) / (k - 1 - first) if k - 1 > first else 0.0
        if cfg.decay == "exponential":
            s = s0 * (s1 / s0) ** u
        elif cfg.decay == "linear":
            s = s0 + (s1 - s0) * u
        elif cfg.decay == "cosine":
            s = s1 + (s0 - s1) * 0.5 * (1.0 + math.cos(math.pi * u))
        else:  # logarithmic
            s = s0 - (s0 - s1) * math.log10(1.0 + 9.0 * u)
        out.append(s)
    return tuple(out)


def aqn_stage(cfg: AQNConfig, step):
    """The stage index of `step` (Python int, or int32 array when step is traced)."""
    k, total = cfg.num_stages, cfg.total_steps
    if isinstance(step, (int, np.integer)):
        if step < 0:
            raise ValueError(f"step must be >= 0; got {step}")
        return min(min(int(step), total) * k // total, k - 1)
    step = jnp.clip(jnp.asarray(step, jnp.int32), 0, total)
    return jnp.minimum(step * k // total, k - 1)


def aqn_sigma(cfg: AQNConfig, step):
    """sigma_t for train step `step` (0-based). Python float for an int step, float32 array if traced."""
    if not cfg.enabled:
        return 0.0 if isinstance(step, (int, np.integer)) else jnp.float32(0.0)
    stage = aqn_stage(cfg, step)
    table = stage_sigmas(cfg)
    if isinstance(stage, int):
        return table[stage]
    return jnp.asarray(table, jnp.float32)[stage]


def apply_aqn(cfg: AQNConfig, norm_params: dict[str, Any], key: jax.Array, step) -> dict[str, Any]:
    """The rollout's norms for `step`: every scale w -> w + N(0, sigma_t^2) per channel (pure, jit-able).

    norm_params: the clean `params["norms"]` ({"final_norm": [D], "layers": {name: [L, D]}}).
    key: the run's AQN key; the step's noise comes from fold_in(key, step), then one sub-key per
    norm leaf (fixed tree order), so the result depends only on (key, step), never on history.
    Returns a pytree of the same structure and dtypes. Disabled AQN returns norm_params itself.
    """
    if not cfg.enabled:
        return norm_params
    sigma = aqn_sigma(cfg, step)
    step_key = jax.random.fold_in(key, jnp.asarray(step, jnp.uint32))
    leaves, treedef = jax.tree.flatten(norm_params)
    noisy = []
    for i, w in enumerate(leaves):
        z = jax.random.normal(jax.random.fold_in(step_key, i), w.shape, jnp.float32)
        noisy.append((w.astype(jnp.float32) + sigma * z).astype(w.dtype))
    return jax.tree.unflatten(treedef, noisy)
