"""The library's config objects (LoRA, AQN, sampling, optimizer) built from a run's ConfigDict."""

from __future__ import annotations

import optax

from qerl_jax import aqn, lora, optim
from qerl_jax.policy import Policy
from qerl_jax.rollout.sampling import SamplingConfig


def lora_config(cfg) -> lora.LoraConfig:
    return lora.LoraConfig(
        rank=cfg.lora.rank, alpha=cfg.lora.alpha, targets=tuple(cfg.lora.targets), rslora=cfg.lora.rslora
    )


def aqn_config(cfg, quant: str) -> aqn.AQNConfig:
    enabled = aqn.default_aqn_enabled(quant) if cfg.aqn.enabled is None else bool(cfg.aqn.enabled)
    return aqn.AQNConfig(
        enabled=enabled,
        sigma_start=cfg.aqn.sigma_start,
        sigma_end=cfg.aqn.sigma_end,
        num_stages=cfg.aqn.num_stages,
        decay=cfg.aqn.decay,
        total_steps=cfg.train.total_steps,
    )


def sampling_config(cfg, policy: Policy) -> SamplingConfig:
    return SamplingConfig(
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        top_k=cfg.rollout.top_k,
        max_new_tokens=cfg.rollout.max_new_tokens,
        eos_ids=policy.stop_ids,
        pad_id=policy.pad_id,
    )


def optimizer_from_config(cfg) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW with warm-up + cosine/constant schedule and grad clipping; also the lr schedule."""
    total = cfg.train.total_steps
    warmup = int(round(cfg.optim.warmup_frac * total))
    optimizer = optim.make_optimizer(
        cfg.optim.lr,
        warmup_steps=warmup,
        total_steps=total,
        schedule=cfg.optim.schedule,
        b1=cfg.optim.b1,
        b2=cfg.optim.b2,
        weight_decay=cfg.optim.weight_decay,
        clip_norm=cfg.optim.clip_norm,
    )
    return optimizer, optim.make_schedule(
        cfg.optim.lr, warmup_steps=warmup, total_steps=total, schedule=cfg.optim.schedule
    )
