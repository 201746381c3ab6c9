"""GRPO-family policy losses, group advantages, sampler/trainer mismatch correction, DAPO's helpers.

All arrays here are on one grid: logp, old_logp, ref_logp, response_mask [B, T] refer to the
same token positions (the train step maps the rollout's token-aligned arrays onto the
next-token grid of `token_logprobs` before calling `policy_loss`). Everything is jit-able.

Per response token, with ratio = exp(logp - old_logp) and advantage A of its sequence:
  pg = max(-A * ratio, -A * clip(ratio, 1 - eps_low, 1 + eps_high))     (PPO clipped surrogate)
  kl = exp(ref - logp) - (ref - logp) - 1                                (k3 estimator, GRPO, beta > 0)
  token_loss = pg + beta * kl
Aggregation (B sequences, M response tokens in the update's batch, L = max_completion_len):
  "grpo":    mean over the B sequences of each sequence's token mean (DeepSeekMath / TRL loss_type="grpo")
  "dapo":    sum over all response tokens / M (token-level, DAPO), no KL.
  "bnpo":    sum over all response tokens / M, KL allowed (TRL's "bnpo", the QeRL reference's loss).
             TRL divides by the tokens of each gradient-accumulation micro-batch; here micro-batches
             never change the update, so the local batch is the update's batch.
  "dr_grpo": sum over all response tokens / (B * L) (Dr. GRPO: no length normalisation; pair it with
             advantages that are not std-scaled, `group_advantages(..., scale="none")`).
The off-policy losses (the sampler's tokens may come from an older adapter):
  "gspo":    GSPO (arXiv 2507.18071; TRL GRPOTrainer importance_sampling_level="sequence" with
             loss_type="grpo"): one ratio per sequence, s = exp(mean over its response tokens of
             (logp - old_logp)), in the same clipped surrogate with clip [1 - gspo_eps_low, 1 + gspo_eps_high]
             (the paper's and TRL's documented 3e-4 / 4e-4), every token of the sequence carrying it;
             aggregated like "grpo" (mean over the sequences), which is the paper's objective.
  "cispo":   CISPO (MiniMax-M1, arXiv 2506.13585; TRL loss_type="cispo"): per token
             pg = -stop_gradient(min(ratio, cispo_eps_max)) * A * logp, so every token keeps a gradient
             (none is clipped away); cispo_eps_max is TRL's epsilon_high under cispo (ScaleRL's
             epsilon_max, recommended 5). Aggregated like "dapo" (sum / M).
Decoupled PPO (AReaL, arXiv 2505.24298; `ppo_actor_loss_fn` with use_decoupled_loss and
behav_imp_weight_cap), old_logp_source="proximal": the ratio is taken against the proximal policy,
the adapter the step's update starts from, recomputed by the train forward (so with one update per
rollout it is stop_gradient(logp), ratio 1); the sampler enters as the stop-gradient behaviour weight
w = pi_prox / pi_sampler per token, and a token whose w exceeds behav_weight_cap gets weight 0
(AReaL filters those tokens out). With one update per step this is old_logp_source="current" with
a token-level masked IS weight (TRL's vllm_importance_sampling_mode="token_mask").
Mismatch correction (old_logp_source="current", where the ratio is 1 and the sampler's log-probs
are otherwise unused): pg is multiplied by a stop-gradient importance weight of the train forward
against the sampler, w = pi_train / pi_sampler (`importance_weights`, TRL's vLLM IS correction).
The log-ratio is clamped to [-20, 20] before exp (as verl) so a far-off token cannot overflow.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

LOSS_KINDS = ("bnpo", "cispo", "dapo", "dr_grpo", "grpo", "gspo")
OLD_LOGP_SOURCES = ("rollout", "current", "proximal")
IS_CORRECTIONS = ("none", "token_truncate", "sequence_truncate", "sequence_mask")
REWARD_SCALES = ("group", "batch", "none")
_MAX_LOG_RATIO = 20.0


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """Policy-loss settings.

    kind: one of LOSS_KINDS (see the module doc): "dapo" (token-level mean, no KL), "bnpo" (token-level
      mean, optional KL), "grpo" (sequence mean then batch mean, optional KL), "dr_grpo" (token sum
      over B * max_completion_len, optional KL), "gspo" (sequence-level ratio, sequence mean),
      "cispo" (clipped stop-gradient IS weight times logp, token-level mean).
    eps_low / eps_high: the ratio is clipped to [1 - eps_low, 1 + eps_high] (clip-higher: eps_high > eps_low).
    beta: weight of the k3 KL to the reference policy (the base without LoRA); GRPO only.
    old_logp_source: "rollout" uses the batch's old_logp (the sampler's log-probs) in the ratio;
      "current" uses stop_gradient(logp), i.e. ratio == 1 with the on-policy gradient, which is
      what TRL does when each rollout batch gets exactly one update (old_logp then only feeds the
      mismatch correction and metrics); "proximal": the decoupled PPO of the module doc (the ratio
      against the recomputed proximal policy, the behaviour weight against the sampler).
    is_correction: "none" or how the sampler/trainer importance weight is formed (needs
      old_logp_source="current": with "rollout" the ratio already is pi_train / pi_sampler):
      "token_truncate" min(w_t, cap); "sequence_truncate" min(prod_t w_t, cap) on every token of
      the sequence; "sequence_mask" prod_t w_t, or 0 for the sequence when above the cap.
    is_cap: the cap C of is_correction (TRL's vllm_importance_sampling_cap, 3).
    max_completion_len: L of "dr_grpo" (the rollout's max_new_tokens); unused by the other kinds.
    gspo_eps_low / gspo_eps_high: the clip of "gspo"'s sequence ratio (GSPO paper v2 section 5.1, TRL's
      documented GSPO setting: 3e-4 / 4e-4); eps_low / eps_high are the token-level kinds'.
    cispo_eps_max: the cap of "cispo"'s IS weight (TRL's epsilon_high with loss_type="cispo", 5 as
      TRL and ScaleRL recommend).
    behav_weight_cap: old_logp_source="proximal": tokens whose behaviour weight pi_prox / pi_sampler
      exceeds it get weight 0 (AReaL's behav_imp_weight_cap, 5 in its GSM8K GRPO config).
    """

    kind: str = "dapo"
    eps_low: float = 0.2
    eps_high: float = 0.28
    beta: float = 0.0
    old_logp_source: str = "rollout"
    is_correction: str = "none"
    is_cap: float = 3.0
    max_completion_len: int = 0
    gspo_eps_low: float = 3e-4
    gspo_eps_high: float = 4e-4
    cispo_eps_max: float = 5.0
    behav_weight_cap: float = 5.0

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
        if self.is_correction not in IS_CORRECTIONS:
            raise ValueError(f"LossConfig.is_correction {self.is_correction!r} is unknown; expected {IS_CORRECTIONS}")
        if self.is_correction != "none" and self.old_logp_source != "current":
            raise ValueError(
                f"LossConfig.is_correction={self.is_correction!r} needs old_logp_source='current': with "
                f"{self.old_logp_source!r} the sampler's log-prob already is "
                + ("the ratio's denominator" if self.old_logp_source == "rollout" else "in the behaviour weight")
            )
        if not (0 <= self.gspo_eps_low < 1 and self.gspo_eps_high >= 0):
            raise ValueError(
                f"LossConfig needs 0 <= gspo_eps_low < 1 and gspo_eps_high >= 0; got {self.gspo_eps_low}, "
                f"{self.gspo_eps_high}"
            )
        if not self.cispo_eps_max > 0:
            raise ValueError(f"LossConfig.cispo_eps_max must be > 0; got {self.cispo_eps_max}")
        if not self.behav_weight_cap >= 1.0:
            raise ValueError(f"LossConfig.behav_weight_cap must be >= 1; got {self.behav_weight_cap}")
        if not self.is_cap >= 1.0:
            raise ValueError(f"LossConfig.is_cap must be >= 1; got {self.is_cap}")
        if self.kind == "dr_grpo" and self.max_completion_len < 1:
            raise ValueError(
                f"LossConfig(kind='dr_grpo') needs max_completion_len >= 1 (the rollout's max_new_tokens); "
                f"got {self.max_completion_len}"
            )

    @property
    def needs_ref(self) -> bool:
        return self.beta > 0


def group_advantages(
    rewards: jax.Array, group_size: int, eps: float = 1e-6, scale: str = "group", ddof: int = 1
) -> jax.Array:
    """GRPO advantages (r - mean_g) / (std + eps) per group of `group_size` consecutive samples.

    rewards: float [num_groups * group_size], the G completions of a prompt adjacent.
    scale (TRL's scale_rewards): "group" divides by the group's std, "batch" by the std of all
      the rewards, "none" returns r - mean_g (Dr. GRPO).
    ddof: 1 (default) is the Bessel-corrected std that TRL (torch .std()) and verl (torch.std)
      use; ddof=0 gives the population std. A group with equal rewards gets advantage 0.
    """
    rewards = jnp.asarray(rewards, jnp.float32)
    if rewards.ndim != 1 or group_size < 1 or rewards.shape[0] % group_size:
        raise ValueError(
            f"rewards must be 1-D with a length divisible by group_size={group_size}; got shape {rewards.shape}"
        )
    if scale not in REWARD_SCALES:
        raise ValueError(f"scale {scale!r} is unknown; expected one of {REWARD_SCALES}")
    if scale != "none" and (group_size if scale == "group" else rewards.shape[0]) - ddof < 1:
        raise ValueError(f"group_size={group_size} is too small for a std with ddof={ddof}")
    r_GxN = rewards.reshape(-1, group_size)
    centered = r_GxN - r_GxN.mean(axis=1, keepdims=True)
    if scale == "group":
        centered = centered / (r_GxN.std(axis=1, ddof=ddof, keepdims=True) + eps)
    elif scale == "batch":
        centered = centered / (rewards.std(ddof=ddof) + eps)
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


def importance_weights(
    logp: jax.Array, sampler_logp: jax.Array, response_mask: jax.Array, cfg: LossConfig
) -> tuple[jax.Array, jax.Array]:
    """Sampler/trainer importance weights, float32 [B, T] (stop-gradient), and where they were capped.

    logp: the train forward's log-probs [B, T]; sampler_logp: the rollout's, same grid. The
    weight of a token is pi_train / pi_sampler (token_*) or the product over its sequence's
    response tokens (sequence_*), capped at the cap (truncate) or zeroed above it (mask);
    1 everywhere for "none". old_logp_source="proximal" takes the token_mask weights with cap
    cfg.behav_weight_cap (decoupled PPO's behaviour weight: pi_train is then the proximal policy);
    else the mode is cfg.is_correction, the cap cfg.is_cap. Returns (weights, over_cap bool [B, T]:
    the raw weight exceeded the cap).
    """
    mode, cap = correction_mode(cfg)
    mask = response_mask.astype(bool)
    log_w = jnp.where(mask, jax.lax.stop_gradient(logp) - sampler_logp, 0.0)
    if mode.startswith("sequence"):
        log_w = jnp.broadcast_to(log_w.sum(axis=1, keepdims=True), log_w.shape)
    w = jnp.exp(jnp.clip(log_w, -_MAX_LOG_RATIO, _MAX_LOG_RATIO))
    over = mask & (w > cap)
    if mode == "none":
        return jnp.ones_like(w), jnp.zeros_like(over)
    if mode.endswith("truncate"):
        return jnp.minimum(w, cap), over
    return jnp.where(over, 0.0, w), over


def correction_mode(cfg: LossConfig) -> tuple[str, float]:
    """(how the sampler's importance weight multiplies the loss, its cap): the decoupled loss's
    ("token_mask", behav_weight_cap) under old_logp_source="proximal", else (is_correction, is_cap)."""
    if cfg.old_logp_source == "proximal":
        return "token_mask", cfg.behav_weight_cap
    return cfg.is_correction, cfg.is_cap


def per_token_terms(
    logp: jax.Array,
    old_logp: jax.Array,
    advantages: jax.Array,
    cfg: LossConfig,
    ref_logp: jax.Array | None = None,
    is_weight: jax.Array | None = None,
    response_mask: jax.Array | None = None,
) -> dict[str, jax.Array]:
    """Unmasked per-token quantities [B, T]: token_loss, pg, ratio, clipped, kl_old (and kl_ref).

    is_weight: the mismatch correction's weights [B, T] (`importance_weights`), multiplying pg.
    response_mask: [B, T], needed by "gspo" (its ratio is the mean log-ratio over these tokens)."""
    if cfg.old_logp_source != "rollout":  # "current" and "proximal": the train forward's own log-probs
        old_logp = jax.lax.stop_gradient(logp)
    log_ratio = jnp.clip(logp - old_logp, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    neg = jax.lax.stop_gradient(-log_ratio)  # metric: k3 estimate of KL(old || current), per token
    if cfg.kind == "gspo":
        if response_mask is None:
            raise ValueError("LossConfig(kind='gspo') needs response_mask: its ratio is a mean over the response")
        log_ratio = jnp.broadcast_to(_sequence_mean(log_ratio, response_mask.astype(bool)), log_ratio.shape)
    ratio = jnp.exp(log_ratio)
    adv = advantages[:, None]
    if cfg.kind == "cispo":
        weight = jnp.minimum(ratio, cfg.cispo_eps_max)
        pg = -jax.lax.stop_gradient(weight) * adv * logp
        clipped = ratio > cfg.cispo_eps_max
    else:
        low, high = (cfg.gspo_eps_low, cfg.gspo_eps_high) if cfg.kind == "gspo" else (cfg.eps_low, cfg.eps_high)
        pg_unclipped = -adv * ratio
        pg_clipped = -adv * jnp.clip(ratio, 1.0 - low, 1.0 + high)
        pg = jnp.maximum(pg_unclipped, pg_clipped)
        clipped = pg_clipped > pg_unclipped
    if is_weight is not None:
        pg = is_weight * pg
    out = {
        "pg": pg,
        "ratio": ratio,
        "clipped": clipped,
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


def _sequence_mean(x_BxT: jax.Array, mask_BxT: jax.Array) -> jax.Array:
    """[B, 1]: each row's mean of x over its masked tokens (0 for a row without any)."""
    n = jnp.maximum(mask_BxT.astype(jnp.float32).sum(axis=1, keepdims=True), 1.0)
    return jnp.where(mask_BxT, x_BxT, 0.0).sum(axis=1, keepdims=True) / n


def loss_normalizer(response_mask: jax.Array, cfg: LossConfig) -> jax.Array:
    """What the summed loss is divided by: the number of response tokens (dapo, bnpo, cispo), of
    sequences (grpo, gspo), or sequences x max_completion_len (dr_grpo)."""
    mask = response_mask.astype(jnp.float32)
    if cfg.kind in ("dapo", "bnpo", "cispo"):
        return jnp.maximum(mask.sum(), 1.0)
    if cfg.kind == "dr_grpo":
        return jnp.float32(mask.shape[0] * cfg.max_completion_len)
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
    """The policy loss of cfg.kind (to minimise) and its metrics.

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
    _check_shapes((b, t), old_logp=old_logp, response_mask=response_mask, ref_logp=ref_logp, entropy=entropy)
    if advantages.shape != (b,):
        raise ValueError(f"advantages has shape {advantages.shape}; expected ({b},)")
    mask = response_mask.astype(bool)
    advantages = jnp.where(mask.any(axis=1), advantages.astype(jnp.float32), 0.0)  # rows without tokens: inert
    is_weight, over_cap = importance_weights(logp, old_logp, mask, cfg)
    old_logp = jnp.where(mask, old_logp, logp)  # padding: ratio 1, whatever garbage logp holds there
    corrected = correction_mode(cfg)[0] != "none"
    terms = per_token_terms(
        logp, old_logp, advantages, cfg, ref_logp, is_weight=is_weight if corrected else None, response_mask=mask
    )
    # The train forward against the batch's old_logp (the sampler's), whatever old_logp_source:
    # how far the sampler (quantized, noisy norms, an older adapter) is from the policy the loss differentiates.
    sampler_cfg = dataclasses.replace(cfg, old_logp_source="rollout", beta=0.0, is_correction="none")
    sampler_terms = (
        terms
        if cfg.old_logp_source == "rollout"
        else per_token_terms(logp, old_logp, advantages, sampler_cfg, response_mask=mask)
    )
    if normalizer is None:
        normalizer = loss_normalizer(response_mask, cfg)
    agg = _aggregator(mask, cfg.kind, normalizer)
    loss = agg(terms["token_loss"])
    metrics = {
        "loss": jax.lax.stop_gradient(loss),
        "pg_loss": jax.lax.stop_gradient(agg(terms["pg"])),
        **_token_metrics(logp, old_logp, advantages, mask, terms, sampler_terms),
        **_optional_metrics(corrected, mask, terms, is_weight, over_cap, entropy),
    }
    return loss, metrics


def _check_shapes(shape: tuple[int, int], **arrays: jax.Array | None) -> None:
    """ValueError naming the first given array whose shape is not logp's [B, T]."""
    for name, x in arrays.items():
        if x is not None and x.shape != shape:
            raise ValueError(f"{name} has shape {x.shape}; expected {shape} like logp")


def _masked(mask: jax.Array, x: jax.Array) -> jax.Array:
    return jnp.where(mask, x, 0.0)  # where, not *, so garbage at padding cannot leak NaN


def _aggregator(mask: jax.Array, kind: str, normalizer: jax.Array | float):
    """x [B, T] -> the loss of `kind` over the response tokens: their sum (grpo: each sequence's token
    mean, summed) divided by `normalizer`."""
    if kind not in ("grpo", "gspo"):
        return lambda x: _masked(mask, x).sum() / normalizer
    seq_len = jnp.maximum(mask.astype(jnp.float32).sum(axis=1), 1.0)
    return lambda x: (_masked(mask, x).sum(axis=1) / seq_len).sum() / normalizer


def _token_mean(mask: jax.Array):
    """x [B, T] -> its stop-gradient mean over the response tokens (0 when there are none)."""
    n_tok = mask.astype(jnp.float32).sum()
    return lambda x: jax.lax.stop_gradient(_masked(mask, x).sum() / jnp.maximum(n_tok, 1.0))


def _token_metrics(logp, old_logp, advantages, mask, terms, sampler_terms) -> dict[str, jax.Array]:
    """`policy_loss`'s metrics of the ratio, the clipping, the sampler's distance, the advantages."""
    n_tok = mask.astype(jnp.float32).sum()
    tok_mean = _token_mean(mask)
    ratio = jax.lax.stop_gradient(terms["ratio"])
    has_tokens = mask.any(axis=1)
    n_seq = jnp.maximum(has_tokens.sum(), 1)
    adv_mean = jnp.where(has_tokens, advantages, 0.0).sum() / n_seq
    adv_var = jnp.where(has_tokens, (advantages - adv_mean) ** 2, 0.0).sum() / n_seq
    sampler_d = jnp.clip(jax.lax.stop_gradient(logp) - old_logp, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return {
        "clip_frac": tok_mean(terms["clipped"].astype(jnp.float32)),
        "sampler_clip_frac": tok_mean(sampler_terms["clipped"].astype(jnp.float32)),
        "sampler_abs_log_ratio": tok_mean(jnp.abs(jax.lax.stop_gradient(logp) - old_logp)),
        "sampler_kl": tok_mean(jnp.exp(sampler_d) - sampler_d - 1.0),
        "approx_kl": tok_mean(terms["kl_old"]),
        "ratio_mean": tok_mean(ratio),
        "ratio_min": jnp.where(n_tok > 0, jnp.min(jnp.where(mask, ratio, jnp.inf)), 1.0),
        "ratio_max": jnp.where(n_tok > 0, jnp.max(jnp.where(mask, ratio, -jnp.inf)), 1.0),
        "adv_mean": jax.lax.stop_gradient(adv_mean),
        "adv_std": jax.lax.stop_gradient(jnp.sqrt(adv_var)),
        "response_tokens": n_tok,
    }


def _optional_metrics(corrected: bool, mask, terms, is_weight, over_cap, entropy) -> dict[str, jax.Array]:
    """`policy_loss`'s metrics of the importance weights (is_correction, or the decoupled loss's behaviour
    weight), the entropy and the KL to the reference, where there are such."""
    n_tok = mask.astype(jnp.float32).sum()
    tok_mean = _token_mean(mask)
    metrics = {}
    if corrected:
        metrics["is_weight_mean"] = tok_mean(is_weight)
        metrics["is_weight_max"] = jnp.where(n_tok > 0, jnp.max(jnp.where(mask, is_weight, -jnp.inf)), 1.0)
        metrics["is_clip_frac"] = tok_mean(over_cap.astype(jnp.float32))
    if entropy is not None:
        metrics["entropy"] = tok_mean(entropy)
    if "kl_ref" in terms:
        metrics["kl_ref"] = tok_mean(terms["kl_ref"])
    return metrics
