"""The LoRA optimizer: global-norm clipping, then AdamW with a warm-up + cosine/constant schedule.

The schedule follows transformers' `get_cosine_schedule_with_warmup` /
`get_constant_schedule_with_warmup` (what TRL, and so QeRL's reference trainer, uses), as a
function of the number of updates already applied `count` (0 for the first update):

  warm-up (count < warmup_steps): lr * count / warmup_steps  (so the first update has lr 0)
  cosine:   lr * 0.5 * (1 + cos(pi * p)),  p = (count - warmup) / max(1, total - warmup), clipped to [0, 1]
  constant: lr
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

SCHEDULES = ("cosine", "constant")


def make_schedule(lr: float, *, warmup_steps: int, total_steps: int, schedule: str = "cosine") -> optax.Schedule:
    """count (int, traced or not) -> learning rate (float32)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule {schedule!r} is unknown; expected one of {SCHEDULES}")
    if not lr > 0:
        raise ValueError(f"learning rate must be > 0; got {lr!r}")
    if warmup_steps < 0 or total_steps < 1:
        raise ValueError(
            f"need warmup_steps >= 0 and total_steps >= 1; got warmup_steps={warmup_steps}, total_steps={total_steps}"
        )
    if warmup_steps > total_steps:
        raise ValueError(f"warmup_steps={warmup_steps} exceeds total_steps={total_steps}")

    def fn(count):
        count = jnp.asarray(count, jnp.float32)
        warm = count / max(1, warmup_steps)
        if schedule == "constant":
            after = jnp.float32(1.0)
        else:
            progress = jnp.clip((count - warmup_steps) / max(1, total_steps - warmup_steps), 0.0, 1.0)
            after = 0.5 * (1.0 + jnp.cos(jnp.pi * progress))
        return lr * jnp.where(count < warmup_steps, warm, after)

    return fn


def make_optimizer(
    lr: float,
    *,
    warmup_steps: int,
    total_steps: int,
    schedule: str = "cosine",
    b1: float = 0.9,
    b2: float = 0.99,
    eps: float = 1e-8,
    weight_decay: float = 0.1,
    clip_norm: float | None = 0.2,
) -> optax.GradientTransformation:
    """clip_by_global_norm(clip_norm) -> AdamW(schedule, b1, b2, eps, decoupled weight_decay).

    Matches torch.nn.utils.clip_grad_norm_ + torch.optim.AdamW (weight decay p -= lr * wd * p,
    applied to every LoRA matrix, not to norm scales: `decay_mask`). clip_norm None/0 disables clipping.
    """
    if clip_norm is not None and clip_norm < 0:
        raise ValueError(f"clip_norm must be >= 0 or None; got {clip_norm}")
    lr_fn = make_schedule(lr, warmup_steps=warmup_steps, total_steps=total_steps, schedule=schedule)
    parts = [optax.clip_by_global_norm(clip_norm)] if clip_norm else []
    parts.append(optax.adamw(lr_fn, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=decay_mask))
    return optax.chain(*parts)


def decay_mask(params: Any) -> Any:
    """True for the leaves weight decay applies to: those with no "norm" in their path.

    As transformers' Trainer (`get_decay_parameter_names`, what QeRL's reference trainer uses),
    which leaves norm weights out of weight decay: trained RMSNorm scales are not decayed to 0.
    """
    has_norm = lambda path: any("norm" in str(getattr(k, "key", "")) for k in path)  # noqa: E731
    return jax.tree_util.tree_map_with_path(lambda path, _: not has_norm(path), params)
