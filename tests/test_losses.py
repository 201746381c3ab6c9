"""GRPO/DAPO losses, advantages and DAPO helpers against plain numpy/torch implementations."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import qerl_jax
from qerl_jax.lora import LoraConfig, init_lora, lora_scale
from qerl_jax.rl.logprobs import token_logprobs
from qerl_jax.rl.losses import (
    LossConfig,
    dynamic_sampling_mask,
    group_advantages,
    overlong_penalty,
    policy_loss,
)


def _np_loss(logp, old, adv, mask, kind, eps_low, eps_high, beta=0.0, ref=None, max_len=None, weight=None):
    """Token-by-token loop implementation of the GRPO/DAPO/BNPO/Dr.GRPO objectives (to minimise).

    weight: per-token importance weights [B, T] multiplying the clipped surrogate (None: 1)."""
    b, t = logp.shape
    seq_losses, tok_sum, n_tok = [], 0.0, 0
    for i in range(b):
        s, n = 0.0, 0
        for j in range(t):
            if not mask[i, j]:
                continue
            r = np.exp(np.float64(logp[i, j]) - old[i, j])
            surrogate = min(r * adv[i], np.clip(r, 1 - eps_low, 1 + eps_high) * adv[i])
            loss = -surrogate * (1.0 if weight is None else weight[i, j])
            if beta:
                d = ref[i, j] - logp[i, j]
                loss += beta * (np.exp(d) - d - 1)
            s, n = s + loss, n + 1
        seq_losses.append(s / max(n, 1))
        tok_sum, n_tok = tok_sum + s, n_tok + n
    if kind in ("dapo", "bnpo"):  # token sum / tokens of the batch
        return tok_sum / max(n_tok, 1)
    if kind == "dr_grpo":  # token sum / (B * max_completion_length)
        return tok_sum / (b * max_len)
    return np.mean(seq_losses)  # grpo: mean of the per-sequence token means


def _hand_batch():
    """4 sequences x 6 tokens: ratios on both sides of both clip bounds, +/- advantages, padding."""
    log_r = np.log(
        np.array(
            [
                [0.5, 1.5, 1.1, 0.9, 1.0, 1.0],  # A > 0: 0.5 unclipped (min picks r*A), 1.5 clipped
                [0.5, 1.5, 1.25, 0.75, 1.0, 1.0],  # A < 0: 0.5 clipped (at 0.8), 1.5 unclipped
                [1.0, 1.3, 0.7, 2.0, 1.0, 1.0],  # A = 0 (a group with equal rewards)
                [1.0, 1.0, 1.0, 1.0, 1.0, 1.0],  # no response tokens at all
            ]
        )
    )
    rng = np.random.default_rng(0)
    old = rng.normal(-2.0, 0.5, (4, 6))
    logp = old + log_r
    mask = np.array([[1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0], [0, 0, 0, 0, 0, 0]], dtype=np.float32)
    logp[mask == 0] = 300.0  # finite garbage at padding must not leak into anything
    adv = np.array([1.5, -0.7, 0.0, 2.0])
    ref = old + rng.normal(0, 0.3, (4, 6))
    entropy = rng.uniform(0.1, 3.0, (4, 6))
    return logp, old, adv, mask, ref, entropy


@pytest.mark.parametrize(
    "kind,beta",
    [("dapo", 0.0), ("grpo", 0.0), ("grpo", 0.05), ("bnpo", 0.0), ("bnpo", 0.05), ("dr_grpo", 0.0), ("dr_grpo", 0.05)],
)
def test_loss_matches_numpy(kind, beta):
    logp, old, adv, mask, ref, entropy = _hand_batch()
    cfg = LossConfig(kind=kind, eps_low=0.2, eps_high=0.28, beta=beta, max_completion_len=9)
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    loss, m = jax.jit(lambda *a: policy_loss(*a, cfg, ref_logp=f32(ref), entropy=f32(entropy)))(
        f32(logp), f32(old), f32(adv), f32(mask)
    )
    want = _np_loss(logp, old, adv, mask, kind, 0.2, 0.28, beta, ref, max_len=9)
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    np.testing.assert_allclose(float(m["loss"]), want, rtol=1e-5)

    sel = mask.astype(bool)
    r = np.exp(logp - old)[sel]
    a = np.broadcast_to(adv[:, None], logp.shape)[sel]
    clipped = np.clip(r, 0.8, 1.28) * a < r * a  # the clipped surrogate is the smaller one
    assert clipped.sum() == 2  # exactly one per side, by construction
    np.testing.assert_allclose(float(m["clip_frac"]), clipped.mean(), rtol=1e-6)
    np.testing.assert_allclose(float(m["ratio_mean"]), r.mean(), rtol=1e-5)
    np.testing.assert_allclose(float(m["ratio_min"]), r.min(), rtol=1e-5)
    np.testing.assert_allclose(float(m["ratio_max"]), r.max(), rtol=1e-5)
    d = (old - logp)[sel]
    np.testing.assert_allclose(float(m["approx_kl"]), np.mean(np.exp(d) - d - 1), rtol=1e-4)
    dr = (ref - logp)[sel]
    np.testing.assert_allclose(float(m["kl_ref"]), np.mean(np.exp(dr) - dr - 1), rtol=1e-4)
    np.testing.assert_allclose(float(m["entropy"]), entropy[sel].mean(), rtol=1e-5)
    has = sel.any(1)
    np.testing.assert_allclose(float(m["adv_mean"]), adv[has].mean(), rtol=1e-6)
    np.testing.assert_allclose(float(m["adv_std"]), adv[has].std(), rtol=1e-5)
    assert float(m["response_tokens"]) == mask.sum()


def test_loss_kinds_aggregate_differently():
    logp, old, adv, mask, _, _ = _hand_batch()
    args = [jnp.asarray(x, jnp.float32) for x in (logp, old, adv, mask)]
    dapo, _ = policy_loss(*args, LossConfig(kind="dapo"))
    grpo, _ = policy_loss(*args, LossConfig(kind="grpo"))
    dr, _ = policy_loss(*args, LossConfig(kind="dr_grpo", max_completion_len=6))
    assert abs(float(dapo) - float(grpo)) > 1e-3  # unequal lengths: token vs sequence averaging
    # Dr. GRPO divides the same token sum by B * L = 24 instead of the 15 response tokens
    np.testing.assert_allclose(float(dr), float(dapo) * mask.sum() / 24, rtol=1e-6)


def test_normalizer_makes_micro_batches_sum_to_full_batch():
    logp, old, adv, mask, ref, _ = _hand_batch()
    for cfg in (
        LossConfig(kind="dapo"),
        LossConfig(kind="grpo", beta=0.1),
        LossConfig(kind="bnpo", beta=0.1),
        LossConfig(kind="dr_grpo", max_completion_len=7, old_logp_source="current", is_correction="sequence_mask"),
    ):
        args = [jnp.asarray(x, jnp.float32) for x in (logp, old, adv, mask)]
        full, _ = policy_loss(*args, cfg, ref_logp=jnp.asarray(ref, jnp.float32))
        norm = {"dapo": mask.sum(), "bnpo": mask.sum(), "grpo": mask.shape[0], "dr_grpo": mask.shape[0] * 7}[cfg.kind]
        parts = [
            policy_loss(
                *[x[i : i + 2] for x in args], cfg, ref_logp=jnp.asarray(ref[i : i + 2], jnp.float32), normalizer=norm
            )[0]
            for i in (0, 2)
        ]
        np.testing.assert_allclose(float(sum(parts)), float(full), rtol=1e-6)


def test_loss_gradient_wrt_logp_matches_torch():
    logp, old, adv, mask, ref, _ = _hand_batch()
    logp[mask == 0] = -1.0
    cfg = LossConfig(kind="grpo", eps_low=0.2, eps_high=0.28, beta=0.05)
    g = jax.grad(
        lambda lp: policy_loss(
            lp, *[jnp.asarray(x, jnp.float32) for x in (old, adv, mask)], cfg, ref_logp=jnp.asarray(ref, jnp.float32)
        )[0]
    )(jnp.asarray(logp, jnp.float32))
    lp = torch.tensor(logp, dtype=torch.float64, requires_grad=True)
    o, a, m, rf = (torch.tensor(x, dtype=torch.float64) for x in (old, adv, mask, ref))
    ratio = torch.exp(lp - o)
    pg = torch.maximum(-a[:, None] * ratio, -a[:, None] * torch.clamp(ratio, 0.8, 1.28))
    kl = torch.exp(rf - lp) - (rf - lp) - 1
    per_tok = (pg + 0.05 * kl) * m
    loss = (per_tok.sum(1) / m.sum(1).clamp(min=1)).mean()
    loss.backward()
    np.testing.assert_allclose(np.asarray(g), lp.grad.numpy(), atol=1e-6, rtol=1e-5)


def test_loss_config_errors():
    with pytest.raises(ValueError, match="kind"):
        LossConfig(kind="ppo")
    with pytest.raises(ValueError, match="DAPO has no KL"):
        LossConfig(kind="dapo", beta=0.1)
    with pytest.raises(ValueError, match="needs ref_logp"):
        x = jnp.zeros((2, 3))
        policy_loss(x, x, jnp.zeros(2), x, LossConfig(kind="grpo", beta=0.1))
    with pytest.raises(ValueError, match="advantages"):
        x = jnp.zeros((2, 3))
        policy_loss(x, x, jnp.zeros(3), x, LossConfig())
    with pytest.raises(ValueError, match="old_logp"):
        policy_loss(jnp.zeros((2, 3)), jnp.zeros((2, 4)), jnp.zeros(2), jnp.zeros((2, 3)), LossConfig())


def test_old_logp_source_current_has_unit_ratio_and_policy_gradient():
    logp, old, adv, mask, _, _ = _hand_batch()
    logp[mask == 0] = -1.0
    args = [jnp.asarray(x, jnp.float32) for x in (old, adv, mask)]
    cfg = LossConfig(kind="dapo", old_logp_source="current")
    f = lambda lp: policy_loss(lp, *args, cfg)  # noqa: E731
    (loss, m), g = jax.value_and_grad(f, has_aux=True)(jnp.asarray(logp, jnp.float32))
    assert float(m["ratio_min"]) == 1.0 == float(m["ratio_max"]) and float(m["clip_frac"]) == 0
    # d/dlogp of -A * exp(logp - sg(logp)) = -A, token-mean over the batch
    want = -np.broadcast_to(adv[:, None], mask.shape) * mask / mask.sum()
    np.testing.assert_allclose(np.asarray(g), want, atol=1e-7)


@pytest.mark.parametrize("beta", [0.0, 0.05])
def test_sampler_metrics_compare_the_train_forward_with_the_rollout_logp_for_both_sources(beta):
    """sampler_clip_frac / sampler_abs_log_ratio measure logp against the batch's old_logp whatever
    old_logp_source: equal to clip_frac under "rollout", and unchanged under "current" (where
    clip_frac is 0)."""
    logp, old, adv, mask, ref, _ = _hand_batch()
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    sel = mask.astype(bool)
    r = np.exp(logp - old)[sel]
    a = np.broadcast_to(adv[:, None], logp.shape)[sel]
    want_clip = (np.clip(r, 0.8, 1.28) * a < r * a).mean()
    want_abs = np.abs(logp - old)[sel].mean()
    for source in ("rollout", "current"):
        cfg = LossConfig(kind="grpo", beta=beta, old_logp_source=source)
        _, m = policy_loss(f32(logp), f32(old), f32(adv), f32(mask), cfg, ref_logp=f32(ref))
        np.testing.assert_allclose(float(m["sampler_clip_frac"]), want_clip, rtol=1e-6)
        np.testing.assert_allclose(float(m["sampler_abs_log_ratio"]), want_abs, rtol=1e-5)
        np.testing.assert_allclose(float(m["clip_frac"]), want_clip if source == "rollout" else 0.0, rtol=1e-6)


@pytest.mark.parametrize("ddof", [0, 1])
def test_group_advantages_match_numpy_and_trl(ddof):
    rewards = np.array([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.5, 1.0, 0.0, 2.0], np.float32)
    adv = np.asarray(group_advantages(jnp.asarray(rewards), 4, eps=1e-6, ddof=ddof))
    g = rewards.reshape(3, 4)
    want = (g - g.mean(1, keepdims=True)) / (g.std(1, ddof=ddof, keepdims=True) + 1e-6)
    np.testing.assert_allclose(adv, want.reshape(-1), rtol=1e-5, atol=1e-6)
    assert np.all(adv[4:8] == 0)  # the equal-reward group gets zero advantage
    if ddof == 1:  # TRL: (r - mean) / (std + eps) with torch's default (Bessel-corrected) std
        t = torch.tensor(rewards).view(-1, 4)
        trl = (t - t.mean(1, keepdim=True)) / (t.std(1, keepdim=True) + 1e-6)
        np.testing.assert_allclose(adv, trl.reshape(-1).numpy(), rtol=1e-5, atol=1e-6)
    unscaled = np.asarray(group_advantages(jnp.asarray(rewards), 4, scale="none"))
    np.testing.assert_allclose(unscaled, (g - g.mean(1, keepdims=True)).reshape(-1), atol=1e-6)
    # TRL's scale_rewards="batch": the group-centred rewards over the std of the whole batch's rewards
    batch = np.asarray(group_advantages(jnp.asarray(rewards), 4, eps=1e-6, scale="batch", ddof=ddof))
    want_batch = (g - g.mean(1, keepdims=True)) / (rewards.std(ddof=ddof) + 1e-6)
    np.testing.assert_allclose(batch, want_batch.reshape(-1), rtol=1e-5, atol=1e-6)
    assert not np.allclose(batch, adv)
    with pytest.raises(ValueError, match="scale"):
        group_advantages(jnp.asarray(rewards), 4, scale="prompt")
    with pytest.raises(ValueError, match="divisible"):
        group_advantages(jnp.asarray(rewards), 5)


def _np_is_weights(logp, sampler, mask, mode, cap):
    """TRL's vLLM importance-sampling correction: exp of the token (or summed sequence) log-ratio of
    the trainer's and the sampler's log-probs, clamped above at cap (truncate) or zeroed above it (mask)."""
    d = (logp.astype(np.float64) - sampler) * mask
    if mode.startswith("sequence"):
        d = np.broadcast_to(d.sum(1, keepdims=True), d.shape)
    r = np.exp(d)
    if mode.endswith("truncate"):
        return np.minimum(r, cap), r > cap
    return np.where(r > cap, 0.0, r), r > cap


@pytest.mark.parametrize("mode", ["token_truncate", "sequence_truncate", "sequence_mask"])
@pytest.mark.parametrize("kind,beta", [("grpo", 0.05), ("bnpo", 0.0)])
def test_is_correction_matches_numpy(mode, kind, beta):
    logp, old, adv, mask, ref, _ = _hand_batch()
    logp[mask == 0] = -1.0
    old = old.copy()
    old[0, :4] -= np.array([0.0, 0.4, 1.5, 0.1])  # row 0: token 2's weight e^1.5 > 3, its product e^2 too
    old[1] -= 0.05  # row 1: all tokens a little above 1, product below the cap
    cap = 3.0
    w, over = _np_is_weights(logp, old, mask, mode, cap)
    sel = mask.astype(bool)
    assert over[sel].any() and not over[sel].all()  # some weights are capped, others not
    cfg = LossConfig(kind=kind, beta=beta, old_logp_source="current", is_correction=mode, is_cap=cap)
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    (loss, m), g = jax.value_and_grad(
        lambda lp: policy_loss(lp, f32(old), f32(adv), f32(mask), cfg, ref_logp=f32(ref)), has_aux=True
    )(f32(logp))
    # old_logp_source="current": ratio 1, so the loss is the IS-weighted -A (+ beta KL)
    want = _np_loss(logp, logp, adv, mask, kind, 0.2, 0.28, beta, ref, weight=w)
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    np.testing.assert_allclose(float(m["is_weight_mean"]), w[sel].mean(), rtol=1e-5)
    np.testing.assert_allclose(float(m["is_weight_max"]), w[sel].max(), rtol=1e-5)
    np.testing.assert_allclose(float(m["is_clip_frac"]), over[sel].mean(), rtol=1e-6)
    d = (logp - old)[sel]
    np.testing.assert_allclose(float(m["sampler_kl"]), np.mean(np.exp(d) - d - 1), rtol=1e-4)
    # the weights are constants: d loss / d logp = -A * w / normaliser (+ the KL's own gradient)
    norm = mask.sum() if kind == "bnpo" else mask.shape[0] * np.maximum(mask.sum(1, keepdims=True), 1)
    dk = ref - logp
    want_g = (-adv[:, None] * w + beta * (1 - np.exp(dk))) * mask / norm
    np.testing.assert_allclose(np.asarray(g), want_g, atol=1e-6, rtol=1e-5)


def test_is_correction_none_leaves_the_loss_unweighted():
    logp, old, adv, mask, _, _ = _hand_batch()
    args = [jnp.asarray(x, jnp.float32) for x in (logp, old, adv, mask)]
    plain, m = policy_loss(*args, LossConfig(old_logp_source="current"))
    tis, _ = policy_loss(*args, LossConfig(old_logp_source="current", is_correction="token_truncate"))
    assert "is_weight_mean" not in m and float(m["sampler_kl"]) > 1e-3
    assert abs(float(plain) - float(tis)) > 1e-3


def test_is_correction_config_errors():
    with pytest.raises(ValueError, match="needs old_logp_source='current'"):
        LossConfig(is_correction="sequence_mask")
    with pytest.raises(ValueError, match="is_correction"):
        LossConfig(old_logp_source="current", is_correction="token_mask")
    with pytest.raises(ValueError, match="is_cap"):
        LossConfig(old_logp_source="current", is_correction="token_truncate", is_cap=0.5)
    with pytest.raises(ValueError, match="max_completion_len"):
        LossConfig(kind="dr_grpo")


def _gspo_batch(scale):
    """5 sequences: each row's token log-ratios scattered around its target sequence ratio s, so that with a
    clip of [1 - 0.75 scale, 1 + scale] (x the eps of the test) row 0 (A > 0) and row 1 (A < 0) are clipped,
    rows 2 and 3 are not, row 4 has no response tokens."""
    rng = np.random.default_rng(1)
    s = 1.0 + scale * np.array([2.5, -2.5, 0.25, -0.5, 0.0])
    rows = [[1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0], [1, 1, 0, 0, 0, 0], [0] * 6]
    mask = np.array(rows, np.float32)
    noise = rng.normal(0, 0.1, (5, 6))
    noise -= (noise * mask).sum(1, keepdims=True) / np.maximum(mask.sum(1, keepdims=True), 1) * mask  # mean 0
    old = rng.normal(-2.0, 0.5, (5, 6))
    logp = old + np.log(s)[:, None] + noise * mask
    logp[mask == 0] = 300.0
    return logp, old, np.array([1.5, -0.7, 0.9, -1.2, 2.0]), mask


def _np_gspo(logp, old, adv, mask, eps_low, eps_high):
    """GSPO, sequence by sequence: s = exp(mean log-ratio), loss = mean over the B sequences of
    -min(s A, clip(s) A), and its gradient in logp (s / n_i per token on the unclipped branch)."""
    losses, grad = [], np.zeros_like(logp)
    for i, a in enumerate(adv):
        sel = mask[i].astype(bool)
        if not sel.any():
            losses.append(0.0)
            continue
        s = np.exp(np.mean(logp[i, sel].astype(np.float64) - old[i, sel]))
        unclipped, clipped = s * a, np.clip(s, 1 - eps_low, 1 + eps_high) * a
        losses.append(-min(unclipped, clipped))
        if unclipped <= clipped:  # min picks s A (or both agree inside the clip range): d/dlogp_t = -A s / n
            grad[i, sel] = -a * s / sel.sum() / len(adv)
    return np.mean(losses), grad


@pytest.mark.parametrize("eps_low,eps_high", [(3e-4, 4e-4), (0.15, 0.2)])
def test_gspo_matches_the_sequence_level_formula(eps_low, eps_high):
    logp, old, adv, mask = _gspo_batch(eps_high)
    cfg = LossConfig(kind="gspo", gspo_eps_low=eps_low, gspo_eps_high=eps_high)
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    (loss, m), g = jax.value_and_grad(lambda lp: policy_loss(lp, f32(old), f32(adv), f32(mask), cfg), has_aux=True)(
        f32(logp)
    )
    want, want_g = _np_gspo(logp, old, adv, mask, eps_low, eps_high)
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(g), want_g, atol=1e-7, rtol=2e-3)
    assert np.abs(want_g[0:2]).max() == 0 and np.abs(want_g[2:4]).min(where=mask[2:4] > 0, initial=1) > 0
    sel = mask.astype(bool)
    n = mask.sum(1)
    s = np.exp(np.where(sel, logp - old, 0).sum(1) / np.maximum(n, 1))
    np.testing.assert_allclose(float(m["clip_frac"]), (n[0] + n[1]) / n.sum(), rtol=1e-6)  # rows 0 and 1, by tokens
    np.testing.assert_allclose(float(m["ratio_mean"]), (s * n).sum() / n.sum(), rtol=1e-5)
    d = (old - logp)[sel]  # approx_kl stays the token-level k3 estimate
    np.testing.assert_allclose(float(m["approx_kl"]), np.mean(np.exp(d) - d - 1), rtol=1e-3)
    # the token-level clip of "grpo" on the same numbers is a different loss
    assert abs(float(policy_loss(f32(logp), f32(old), f32(adv), f32(mask), LossConfig(kind="grpo"))[0]) - want) > 1e-3


@pytest.mark.parametrize("eps_max,beta", [(1.4, 0.0), (5.0, 0.05)])
def test_cispo_matches_the_clipped_stop_gradient_weight_formula(eps_max, beta):
    """TRL's cispo: -stop_gradient(min(ratio, eps_max)) * A * logp per token, summed over the batch's response
    tokens / their number; its gradient is -min(ratio, eps_max) * A / M on every token (none is dropped)."""
    logp, old, adv, mask, ref, _ = _hand_batch()
    logp[mask == 0] = -1.0
    cfg = LossConfig(kind="cispo", cispo_eps_max=eps_max, beta=beta)
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    (loss, m), g = jax.value_and_grad(
        lambda lp: policy_loss(lp, f32(old), f32(adv), f32(mask), cfg, ref_logp=f32(ref)), has_aux=True
    )(f32(logp))
    r = np.exp(logp.astype(np.float64) - old)
    w = np.minimum(r, eps_max)
    a = adv[:, None]
    dk = ref - logp
    m_tok = mask.sum()
    want = ((-w * a * logp + beta * (np.exp(dk) - dk - 1)) * mask).sum() / m_tok
    want_g = (-w * a + beta * (1 - np.exp(dk))) * mask / m_tok
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(g), want_g, atol=1e-7, rtol=1e-5)
    capped = (r > eps_max) & mask.astype(bool)
    assert capped.sum() == (3 if eps_max < 1.5 else 0)  # ratios 1.5 (rows 0 and 1) and 2.0 (row 2)
    np.testing.assert_allclose(float(m["clip_frac"]), capped.sum() / m_tok, rtol=1e-6)


def test_decoupled_ppo_weights_the_proximal_ratio_by_the_masked_behaviour_weight():
    """old_logp_source="proximal" (AReaL's decoupled loss, one update per rollout): the ratio against the
    recomputed proximal log-probs is 1; each token's -A is weighted by w = pi_prox / pi_sampler, 0 where
    w > behav_weight_cap; the gradient is -A w / M."""
    logp, old, adv, mask, _, _ = _hand_batch()
    logp[mask == 0] = -1.0
    cap = 1.4
    cfg = LossConfig(kind="dapo", old_logp_source="proximal", behav_weight_cap=cap)
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    (loss, m), g = jax.value_and_grad(lambda lp: policy_loss(lp, f32(old), f32(adv), f32(mask), cfg), has_aux=True)(
        f32(logp)
    )
    sel = mask.astype(bool)
    r = np.exp(logp.astype(np.float64) - old)
    w = np.where(r > cap, 0.0, r) * mask
    want_g = -adv[:, None] * w / mask.sum()
    np.testing.assert_allclose(float(loss), want_g.sum(), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(g), want_g, atol=1e-7, rtol=1e-5)
    assert float(m["ratio_min"]) == 1.0 == float(m["ratio_max"])
    np.testing.assert_allclose(float(m["is_weight_mean"]), w[sel].mean(), rtol=1e-5)
    np.testing.assert_allclose(float(m["is_clip_frac"]), (r[sel] > cap).mean(), rtol=1e-6)
    assert 0 < (r[sel] > cap).sum() < sel.sum()


def test_off_policy_loss_config_errors():
    with pytest.raises(ValueError, match="behaviour weight"):
        LossConfig(old_logp_source="proximal", is_correction="token_truncate")
    with pytest.raises(ValueError, match="cispo_eps_max"):
        LossConfig(kind="cispo", cispo_eps_max=0.0)
    with pytest.raises(ValueError, match="behav_weight_cap"):
        LossConfig(old_logp_source="proximal", behav_weight_cap=0.5)
    with pytest.raises(ValueError, match="gspo_eps_low"):
        LossConfig(kind="gspo", gspo_eps_low=1.0)
    with pytest.raises(ValueError, match="needs response_mask"):
        from qerl_jax.rl.losses import per_token_terms

        x = jnp.zeros((2, 3))
        per_token_terms(x, x, jnp.zeros(2), LossConfig(kind="gspo"))


def test_dynamic_sampling_mask():
    rewards = jnp.array([1, 1, 1, 0, 0, 0, 1, 0, 0.5, 0.5, 0.5, 0.5])
    keep = np.asarray(dynamic_sampling_mask(rewards, 3))
    np.testing.assert_array_equal(keep, [False, False, True, False])
    np.testing.assert_array_equal(np.asarray(dynamic_sampling_mask(rewards, 4)), [True, True, False])


def test_overlong_penalty_matches_dapo_formula():
    max_len, cache = 100, 20

    def dapo(length):  # DAPO paper, eq. 13
        if length <= max_len - cache:
            return 0.0
        if length <= max_len:
            return ((max_len - cache) - length) / cache
        return -1.0

    lengths = np.array([0, 50, 80, 81, 90, 99, 100, 120])
    got = np.asarray(overlong_penalty(jnp.asarray(lengths), max_len, cache, penalty=1.0))
    np.testing.assert_allclose(got, [dapo(x) for x in lengths], atol=1e-7)
    np.testing.assert_allclose(
        np.asarray(overlong_penalty(jnp.asarray(lengths), max_len, cache, penalty=0.5)), 0.5 * got
    )
    with pytest.raises(ValueError, match="cache_len"):
        overlong_penalty(jnp.asarray(lengths), 10, 20)


def test_grpo_gradient_wrt_lora_matches_finite_differences(tiny_qwen2_dir):
    path, _ = tiny_qwen2_dir
    config, params = qerl_jax.load_model(path, dtype="float32")
    lcfg = LoraConfig(rank=4, alpha=8.0, targets=("q_proj", "v_proj", "down_proj"))
    lora = init_lora(jax.random.key(1), config, lcfg)
    keys = iter(jax.random.split(jax.random.key(2), 16))
    lora = jax.tree.map(lambda x: x + 0.1 * jax.random.normal(next(keys), x.shape), lora)  # B != 0
    rng = np.random.default_rng(0)
    b, t = 3, 10
    ids = jnp.asarray(rng.integers(0, config.vocab_size, (b, t)), jnp.int32)
    am = np.ones((b, t), np.int32)
    am[1, :2] = 0
    mask = np.zeros((b, t - 1), np.float32)
    mask[:, 4:] = 1
    mask[2, 7:] = 0
    scale = lora_scale(lcfg)
    logp_fn = jax.jit(
        lambda lo: token_logprobs(config, {**params, "lora": lo}, ids, jnp.asarray(am), lora_scale=scale)[0]
    )
    logp0 = logp_fn(lora)
    ref = logp_fn(
        {"layers": {k: {"a": v["a"], "b": jnp.zeros_like(v["b"])} for k, v in lora["layers"].items()}}
    )  # = base
    old = logp0 + jnp.asarray(rng.normal(0, 0.3, logp0.shape), jnp.float32)  # ratios on both sides of the clip range
    adv = jnp.array([-1.0, 0.5, 0.8])
    cfg = LossConfig(kind="grpo", eps_low=0.2, eps_high=0.28, beta=0.1)
    _, m = policy_loss(logp0, old, adv, jnp.asarray(mask), cfg, ref_logp=ref)
    assert 0 < float(m["clip_frac"]) < 1  # both clipped and unclipped tokens take part
    assert float(m["kl_ref"]) > 1e-4

    def loss_fn(lo):
        lp, _ = token_logprobs(config, {**params, "lora": lo}, ids, jnp.asarray(am), lora_scale=scale)
        return policy_loss(lp, old, adv, jnp.asarray(mask), cfg, ref_logp=ref)[0]

    value_and_grad = jax.jit(jax.value_and_grad(loss_fn))  # one compile, reused for the loss evaluations
    _, grad = value_and_grad(lora)
    for seed in range(3):
        ks = iter(jax.random.split(jax.random.key(10 + seed), 16))
        v = jax.tree.map(lambda x, ks=ks: jax.random.normal(next(ks), x.shape), lora)
        h = 3e-2 / np.sqrt(sum(float(jnp.sum(x * x)) for x in jax.tree.leaves(v)))
        plus, _ = value_and_grad(jax.tree.map(lambda p, d, h=h: p + h * d, lora, v))
        minus, _ = value_and_grad(jax.tree.map(lambda p, d, h=h: p - h * d, lora, v))
        fd = (float(plus) - float(minus)) / (2 * h)
        analytic = sum(float(jnp.sum(g * d)) for g, d in zip(jax.tree.leaves(grad), jax.tree.leaves(v)))
        assert abs(analytic) > 1e-3
        np.testing.assert_allclose(fd, analytic, rtol=5e-3)
