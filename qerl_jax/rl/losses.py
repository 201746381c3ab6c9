"""GRPO and DAPO policy losses, group advantages and DAPO's sampling/reward helpers.

All arrays here are on one grid: logp, old_logp, ref_logp, response_mask [B, T] refer to the
same token positions (the train step maps the rollout's token-aligned arrays onto the
next-token grid of `token_logprobs` before calling `policy_loss`). Everything is jit-able.

Per response token, with ratio = exp(logp - old_logp) and advantage A of its sequence:
  pg = max(-A * ratio, -A * clip(ratio, 1 - eps_low, 1 + eps_high))     (PPO clipped surrogate)
  kl = exp(ref - logp) - (ref - logp) - 1                                (k3 estimator, GRPO, beta > 0)
  token_loss = pg + beta * kl
Aggregation:
  "grpo": mean over the B sequences of each sequence's token mean (DeepSeekMath / TRL loss_type="grpo")
  "dapo": sum over all response tokens of the batch / their number (token-level, DAPO), no KL.
The log-ratio is clamped to [-20, 20] before exp (as verl) so a far-off token cannot overflow.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

LOSS_KINDS = ("dapo", "grpo")
OLD_LOGP_SOURCES = ("rollout", "current")
_MAX_LOG_RATIO = 20.0


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """Policy-loss settings.

    kind: "dapo" (token-level mean, no KL) or "grpo" (sequence mean then batch mean, optional KL).
    eps_low / eps_high: the ratio is clipped to [1 - eps_low, 1 + eps_high] (clip-higher: eps_high > eps_low).
    beta: weight of the k3 KL to the reference policy (the base without LoRA); GRPO only.
    old_logp_source: "rollout" uses the batch's old_logp (the sampler's log-probs) in the ratio;
      "current" uses stop_gradient(logp), i.e. ratio == 1 with the on-policy gradient, which is
      what TRL does when each rollout batch gets exactly one update (old_logp then unused).
    """

    kind: str = "dapo"
    eps_low: float = 0.2
    eps_high: float = 0.28
    beta: float = 0.0
    old_logp_source: str = "rollout"

    def __post_init__(self):
        if self.kind not in LOSS_KINDS:
            raise ValueError(f"LossConfig.kind {self.kind!r} is unknown; expected one of {LOSS_KINDS}")
        if not (0 <= self.eps_low < 1 and self.eps_high >= 0):
            raise ValueError(
                f"LossConfig needs 0 <= eps_low < 1 and eps_high >= 0; got {self.eps_low}, {self.eps_high}"
            )
        if self.beta < 0:
            raise ValueError(f"LossConfig.beta must be >= 0; got {self.beta}")
        if self.kind == "dapo" and self.beta != 0:
            raise ValueError(f"DAPO has no KL term; got beta={self.beta}. Use kind='grpo' for a KL penalty")
        if self.old_logp_source not in OLD_LOGP_SOURCES:
            raise ValueError(
                f"LossConfig.old_logp_source {self.old_logp_source!r} is unknown; expected {OLD_LOGP_SOURCES}"
            )

    @property
    def needs_ref(self) -> bool:
        return self.beta > 0


def group_advantages(
    rewards: jax.Array, group_size: int, eps: float = 1e-6, scale_by_std: bool = True, ddof: int = 1
) -> jax.Array:
    """GRPO advantages (r - mean_g) / (std_g + eps) per group of `group_size` consecutive samples.

    rewards: float [num_groups * group_size], the G completions of a prompt adjacent.
    ddof: 1 (default) is the Bessel-corrected std that TRL (torch .std()) and verl (torch.std)
      use; ddof=0 gives the population std. A group with equal rewards gets advantage 0.
    scale_by_std=False returns r - mean_g (Dr. GRPO).
    """
    rewards = jnp.asarray(rewards, jnp.float32)
    if rewards.ndim != 1 or group_size < 1 or rewards.shape[0] % group_size:
        raise ValueError(
            f"rewards must be 1-D with a length divisible by group_size={group_size}; got shape {rewards.shape}"
        )
    if scale_by_std and group_size - ddof < 1:
        raise ValueError(f"group_size={group_size} is too small for a std with ddof={ddof}")
    r_GxN = rewards.reshape(-1, group_size)
    centered = r_GxN - r_GxN.mean(axis=1, keepdims=True)
    if scale_by_std:
        centered = centered / (r_GxN.std(axis=1, ddof=ddof, keepdims=True) + eps)
    return centered.reshape(-1)


def dynamic_sampling_mask(rewards: jax.Array, group_size: int) -> jax.Array:
    """DAPO dynamic sampling: bool [num_groups], False for groups whose rewards are all equal.

    Such groups have zero advantage (no gradient); the loop drops them and refills the batch
    from further prompts until it has enough kept groups.
    """
    rewards = jnp.asarray(rewards)
    if rewards.ndim != 1 or group_size < 1 or rewards.shape[0] % group_size:
        raise ValueError(
            f"rewards must be 1-D with a length divisible by group_size={group_size}; got shape {rewards.shape}"
        )
    r_GxN = rewards.reshape(-1, group_size)
    return jnp.any(r_GxN != r_GxN[:, :1], axis=1)


def overlong_penalty(lengths: jax.Array, max_len: int, cache_len: int, penalty: float = 1.0) -> jax.Array:
    """DAPO soft overlong punishment, added to the reward; float32 like `lengths`.

    0 for L <= max_len - cache_len, then linear ((max_len - cache_len) - L) / cache_len * penalty
    down to -penalty at L = max_len, and -penalty beyond.
    """
    if not 0 < cache_len <= max_len:
        raise ValueError(
            f"overlong_penalty needs 0 < cache_len <= max_len; got cache_len={cache_len}, max_len={max_len}"
        )
    lengths = jnp.asarray(lengths, jnp.float32)
    over = (lengths - (max_len - cache_len)) / cache_len
    return -penalty * jnp.clip(over, 0.0, 1.0)


def per_token_terms(
    logp: jax.Array,
    old_logp: jax.Array,
    advantages: jax.Array,
    cfg: LossConfig,
    ref_logp: jax.Array | None = None,
) -> dict[str, jax.Array]:
    """Unmasked per-token quantities [B, T]: token_loss, pg, ratio, clipped, kl_old (and kl_ref)."""
    if cfg.old_logp_source == "current":
        old_logp = jax.lax.stop_gradient(logp)
    log_ratio = jnp.clip(logp - old_logp, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = jnp.exp(log_ratio)
    adv = advantages[:, None]
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * jnp.clip(ratio, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high)
    pg = jnp.maximum(pg_unclipped, pg_clipped)
    neg = jax.lax.stop_gradient(-log_ratio)  # metric: k3 estimate of KL(old || current)
    out = {
        "pg": pg,
        "ratio": ratio,
        "clipped": pg_clipped > pg_unclipped,
        "kl_old": jnp.exp(neg) - neg - 1.0,
        "token_loss": pg,
    }
    if cfg.needs_ref:
        if ref_logp is None:
            raise ValueError(f"LossConfig.beta={cfg.beta} > 0 needs ref_logp (log-probs of the reference policy)")
        d = jnp.clip(ref_logp - logp, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        out["kl_ref"] = jnp.exp(d) - d - 1.0
        out["token_loss"] = pg + cfg.beta * out["kl_ref"]
    elif ref_logp is not None:
        d = jax.lax.stop_gradient(jnp.clip(ref_logp - logp, -_MAX_LOG_RATIO, _MAX_LOG_RATIO))
        out["kl_ref"] = jnp.exp(d) - d - 1.0
    return out


def loss_normalizer(response_mask: jax.Array, cfg: LossConfig) -> jax.Array:
    """What the summed loss is divided by: the number of response tokens (dapo) or of sequences (grpo)."""
    mask = response_mask.astype(jnp.float32)
    if cfg.kind == "dapo":
        return jnp.maximum(mask.sum(), 1.0)
    return jnp.float32(mask.shape[0])


def policy_loss(
    logp: jax.Array,
    old_logp: jax.Array,
    advantages: jax.Array,
    response_mask: jax.Array,
    cfg: LossConfig,
    *,
    ref_logp: jax.Array | None = None,
    entropy: jax.Array | None = None,
    normalizer: jax.Array | float | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The GRPO/DAPO loss (to minimise) and its metrics.

    Args:
      logp: float32 [B, T], current policy log-probs of the sampled tokens (differentiable).
      old_logp: [B, T], the sampling policy's log-probs; advantages: [B]; response_mask: [B, T].
      ref_logp: [B, T] reference log-probs (required when cfg.beta > 0; else only a metric).
      entropy: [B, T] policy entropy, for the metric only.
      normalizer: overrides `loss_normalizer(response_mask, cfg)`; micro-batches pass the
        full batch's value so that their losses (and gradients) sum to the full-batch ones.
    Returns:
      (loss scalar, metrics dict of float32 scalars: loss, pg_loss, clip_frac, approx_kl,
       ratio_mean/min/max, adv_mean/std, response_tokens, sampler_clip_frac and
       sampler_abs_log_ratio (clip fraction and mean |logp - old_logp| against the batch's
       old_logp even when old_logp_source="current"), and entropy / kl_ref when available).
    """
    b, t = logp.shape
    for name, x in (
        ("old_logp", old_logp),
        ("response_mask", response_mask),
        ("ref_logp", ref_logp),
        ("entropy", entropy),
    ):
        if x is not None and x.shape != (b, t):
            raise ValueError(f"{name} has shape {x.shape}; expected {(b, t)} like logp")
    if advantages.shape != (b,):
        raise ValueError(f"advantages has shape {advantages.shape}; expected ({b},)")
    mask = response_mask.astype(bool)
    maskf = mask.astype(jnp.float32)
    advantages = jnp.where(mask.any(axis=1), advantages.astype(jnp.float32), 0.0)  # rows without tokens: inert
    terms = per_token_terms(logp, jnp.where(mask, old_logp, logp), advantages, cfg, ref_logp)
    # The train forward against the batch's old_logp (the sampler's), whatever old_logp_source:
    # how far the sampler (quantized, noisy norms) is from the policy the loss differentiates.
    sampler_cfg = dataclasses.replace(cfg, old_logp_source="rollout", beta=0.0)
    sampler_terms = (
        terms if cfg.old_logp_source == "rollout" else per_token_terms(logp, old_logp, advantages, sampler_cfg)
    )
    masked = lambda x: jnp.where(mask, x, 0.0)  # noqa: E731  (where, not *, so garbage at padding cannot leak NaN)

    if normalizer is None:
        normalizer = loss_normalizer(response_mask, cfg)
    if cfg.kind == "dapo":
        agg = lambda x: masked(x).sum() / normalizer  # noqa: E731
    else:
        seq_len = jnp.maximum(maskf.sum(axis=1), 1.0)
        agg = lambda x: (masked(x).sum(axis=1) / seq_len).sum() / normalizer  # noqa: E731
    loss = agg(terms["token_loss"])

    n_tok = maskf.sum()
    tok_mean = lambda x: jax.lax.stop_gradient(masked(x).sum() / jnp.maximum(n_tok, 1.0))  # noqa: E731
    ratio = jax.lax.stop_gradient(terms["ratio"])
    has_tokens = mask.any(axis=1)
    n_seq = jnp.maximum(has_tokens.sum(), 1)
    adv_mean = jnp.where(has_tokens, advantages, 0.0).sum() / n_seq
    adv_var = jnp.where(has_tokens, (advantages - adv_mean) ** 2, 0.0).sum() / n_seq
    metrics = {
        "loss": jax.lax.stop_gradient(loss),
        "pg_loss": jax.lax.stop_gradient(agg(terms["pg"])),
        "clip_frac": tok_mean(terms["clipped"].astype(jnp.float32)),
        "sampler_clip_frac": tok_mean(sampler_terms["clipped"].astype(jnp.float32)),
        "sampler_abs_log_ratio": tok_mean(jnp.abs(jax.lax.stop_gradient(logp) - old_logp)),
        "approx_kl": tok_mean(terms["kl_old"]),
        "ratio_mean": tok_mean(ratio),
        "ratio_min": jnp.where(n_tok > 0, jnp.min(jnp.where(mask, ratio, jnp.inf)), 1.0),
        "ratio_max": jnp.where(n_tok > 0, jnp.max(jnp.where(mask, ratio, -jnp.inf)), 1.0),
        "adv_mean": jax.lax.stop_gradient(adv_mean),
        "adv_std": jax.lax.stop_gradient(jnp.sqrt(adv_var)),
        "response_tokens": n_tok,
    }
    if entropy is not None:
        metrics["entropy"] = tok_mean(entropy)
    if "kl_ref" in terms:
        metrics["kl_ref"] = tok_mean(terms["kl_ref"])
    return loss, metrics
