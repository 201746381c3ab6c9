"""Adaptive Quantization Noise: the stage schedule, the noise itself, and its effect on the forward."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import qerl_jax
from qerl_jax.aqn import AQNConfig, apply_aqn, aqn_sigma, aqn_stage, default_aqn_enabled, stage_sigmas


def _reference_sigma(step, total_steps, sigma_trend):
    """QeRL's reference `get_sigma_by_step` (trl_trainer/noise_scheduler.py), re-typed from its logic."""
    step = min(step, total_steps)
    steps_per_interval = total_steps / (len(sigma_trend) + 1)
    interval_id = int(step // steps_per_interval)
    if interval_id == 0:
        return 0.0
    return sigma_trend[min(interval_id - 1, len(sigma_trend) - 1)]


@pytest.mark.parametrize("total", [100, 600, 37, 5])
def test_exponential_schedule_matches_closed_form_and_reference(total):
    cfg = AQNConfig(enabled=True, sigma_start=1e-2, sigma_end=1e-4, num_stages=10, total_steps=total)
    trend = [1e-2 * (1e-4 / 1e-2) ** ((j - 1) / 8) for j in range(1, 10)]  # stages 1..9
    np.testing.assert_allclose(stage_sigmas(cfg), [0.0] + trend, rtol=1e-12)
    assert stage_sigmas(cfg)[1] == pytest.approx(1e-2) and stage_sigmas(cfg)[-1] == pytest.approx(1e-4)
    sigma_jit = jax.jit(lambda s: aqn_sigma(cfg, s))
    for step in range(total + 3):
        want = _reference_sigma(step, total, trend)
        assert aqn_sigma(cfg, step) == pytest.approx(want, rel=1e-12, abs=0)
        assert float(sigma_jit(step)) == pytest.approx(want, rel=1e-6, abs=0)
    assert aqn_sigma(cfg, 0) == 0.0
    if total >= cfg.num_stages:  # every stage is reached: the run ends at sigma_end
        assert aqn_sigma(cfg, total - 1) == pytest.approx(1e-4)


def test_stages_split_the_run_evenly():
    cfg = AQNConfig(enabled=True, num_stages=10, total_steps=600)
    assert [aqn_stage(cfg, s) for s in (0, 59, 60, 119, 120, 599, 600, 10**6)] == [0, 0, 1, 1, 2, 9, 9, 9]


@pytest.mark.parametrize("decay", ["linear", "cosine", "logarithmic"])
def test_other_decays(decay):
    s0, s1, k = 5e-2, 5e-4, 6
    cfg = AQNConfig(enabled=True, sigma_start=s0, sigma_end=s1, num_stages=k, decay=decay, total_steps=60)
    sig = stage_sigmas(cfg)
    assert sig[0] == 0.0 and sig[1] == pytest.approx(s0) and sig[-1] == pytest.approx(s1)
    assert all(a > b for a, b in zip(sig[1:], sig[2:]))  # strictly decreasing over the noisy stages
    u = 2 / (k - 2)  # stage 3
    want = {
        "linear": s0 + (s1 - s0) * u,
        "cosine": s1 + (s0 - s1) * (1 + math.cos(math.pi * u)) / 2,
        "logarithmic": s0 - (s0 - s1) * math.log10(1 + 9 * u),
    }[decay]
    assert sig[3] == pytest.approx(want, rel=1e-12)


def _norms(d=4096, layers=4, dtype=jnp.float32):
    rng = np.random.default_rng(0)
    return {
        "final_norm": jnp.asarray(1 + 0.1 * rng.normal(size=d), dtype),
        "layers": {
            "input_layernorm": jnp.asarray(1 + 0.1 * rng.normal(size=(layers, d)), dtype),
            "post_attention_layernorm": jnp.asarray(1 + 0.1 * rng.normal(size=(layers, d)), dtype),
        },
    }


def test_noise_is_gaussian_channelwise_independent_fresh_and_not_accumulating():
    cfg = AQNConfig(enabled=True, sigma_start=1e-2, sigma_end=1e-4, num_stages=10, total_steps=100)
    clean, key, step = _norms(), jax.random.key(7), 15  # stage 1: sigma = 1e-2
    noisy = apply_aqn(cfg, clean, key, step)
    z = jax.tree.map(lambda a, b: np.asarray(a, np.float64) - np.asarray(b, np.float64), noisy, clean)
    assert jax.tree.structure(noisy) == jax.tree.structure(clean)
    for leaf, ref in zip(jax.tree.leaves(noisy), jax.tree.leaves(clean)):
        assert leaf.shape == ref.shape and leaf.dtype == ref.dtype
    allz = np.concatenate([x.reshape(-1) for x in jax.tree.leaves(z)])
    assert abs(allz.std() / 1e-2 - 1) < 0.03 and abs(allz.mean()) < 3e-4  # N(0, sigma^2)
    rows = np.concatenate(
        [z["layers"]["input_layernorm"], z["layers"]["post_attention_layernorm"], z["final_norm"][None]]
    )
    corr = np.corrcoef(rows)
    assert np.abs(corr[~np.eye(len(rows), dtype=bool)]).max() < 0.1  # independent per layer and per norm

    again = apply_aqn(cfg, clean, key, step)  # same key and step, from the clean norms: identical
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(noisy)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    nxt = apply_aqn(cfg, clean, key, step + 1)  # next step: fresh noise (same stage, same sigma)
    z2 = np.asarray(nxt["final_norm"]) - np.asarray(clean["final_norm"])
    assert abs(np.corrcoef(z2, z["final_norm"])[0, 1]) < 0.1 and abs(z2.std() / 1e-2 - 1) < 0.05
    other_key = apply_aqn(cfg, clean, jax.random.key(8), step)
    assert not np.allclose(np.asarray(other_key["final_norm"]), np.asarray(noisy["final_norm"]))
    jitted = jax.jit(lambda n, s: apply_aqn(cfg, n, key, s))(clean, jnp.int32(step))  # step traced
    for a, b in zip(jax.tree.leaves(jitted), jax.tree.leaves(noisy)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)


def test_stage_zero_and_disabled_leave_norms_unchanged():
    clean = _norms(d=64, dtype=jnp.bfloat16)
    on = AQNConfig(enabled=True, total_steps=100)
    off = AQNConfig(enabled=False)
    for cfg, step in ((on, 0), (on, 9), (off, 50)):
        out = apply_aqn(cfg, clean, jax.random.key(0), step)
        for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(clean)):
            assert a.dtype == b.dtype
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("decay", ["exponential", "linear"])
def test_first_stage_noise_starts_the_schedule_at_step_0(decay):
    """aqn.first_stage_noise: every stage adds noise, from sigma_start at step 0 to sigma_end in the last."""
    cfg = AQNConfig(enabled=True, sigma_start=3e-2, sigma_end=3e-4, num_stages=3, total_steps=180, decay=decay,
                    first_stage_noise=True)
    want = (3e-2, 3e-3, 3e-4) if decay == "exponential" else (3e-2, (3e-2 + 3e-4) / 2, 3e-4)
    np.testing.assert_allclose(stage_sigmas(cfg), want, rtol=1e-12)
    assert [aqn_sigma(cfg, t) for t in (0, 59, 60, 119, 120, 179)] == pytest.approx([want[0]] * 2 + [want[1]] * 2 + [want[2]] * 2)
    assert float(jax.jit(lambda s: aqn_sigma(cfg, s))(0)) == pytest.approx(want[0])
    clean = _norms(d=64, dtype=jnp.float32)
    noisy = apply_aqn(cfg, clean, jax.random.key(0), 0)
    z = np.asarray(noisy["final_norm"]) - np.asarray(clean["final_norm"])
    assert 0.5 * want[0] < z.std() < 2 * want[0]  # stage 0 is noisy now
    default = AQNConfig(enabled=True, sigma_start=3e-2, sigma_end=3e-4, num_stages=3, total_steps=180)
    assert stage_sigmas(default) == pytest.approx((0.0, 3e-2, 3e-4)) and aqn_sigma(default, 0) == 0.0


def _hf_logits(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.tensor(ids, dtype=torch.long)).logits.numpy()


def test_noisy_norm_forward_equals_transformers_with_replaced_norm_weights(tiny_qwen2_dir):
    path, model = tiny_qwen2_dir
    config, params = qerl_jax.load_model(path, dtype="float32")
    cfg = AQNConfig(enabled=True, sigma_start=0.2, sigma_end=0.01, num_stages=4, total_steps=40)
    ids = np.random.default_rng(0).integers(0, config.vocab_size, (2, 10)).astype(np.int32)
    fwd = jax.jit(lambda p: qerl_jax.forward(config, p, ids))
    noisy = apply_aqn(cfg, params["norms"], jax.random.key(3), 12)  # stage 1: sigma 0.2
    ours_clean = np.asarray(fwd(params))
    ours_noisy = np.asarray(fwd({**params, "norms": noisy}))
    np.testing.assert_array_equal(
        np.asarray(fwd({**params, "norms": apply_aqn(cfg, params["norms"], jax.random.key(3), 5)})), ours_clean
    )

    sd = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        with torch.no_grad():  # w + z written into the torch model by name, independently of our tree layout
            model.model.norm.weight.copy_(torch.tensor(np.asarray(noisy["final_norm"])))
            for i, layer in enumerate(model.model.layers):
                layer.input_layernorm.weight.copy_(torch.tensor(np.asarray(noisy["layers"]["input_layernorm"][i])))
                layer.post_attention_layernorm.weight.copy_(
                    torch.tensor(np.asarray(noisy["layers"]["post_attention_layernorm"][i]))
                )
        ref_noisy = _hf_logits(model, ids)
    finally:
        model.load_state_dict(sd)
    ref_clean = _hf_logits(model, ids)
    scale = np.abs(ref_noisy).max()
    assert np.abs(ref_noisy - ref_clean).max() > 50 * 1e-4 * scale  # the noise visibly changes the logits
    np.testing.assert_allclose(ours_noisy, ref_noisy, atol=1e-4 * scale)
    np.testing.assert_allclose(ours_clean, ref_clean, atol=1e-4 * scale)


def test_default_enabled_and_config_errors():
    assert default_aqn_enabled("nvfp4") and default_aqn_enabled("mxfp4") and default_aqn_enabled("nf4")
    assert not default_aqn_enabled("bf16")
    with pytest.raises(ValueError, match="quantization format"):
        default_aqn_enabled("int8")
    with pytest.raises(ValueError, match="total_steps"):
        AQNConfig(enabled=True)
    with pytest.raises(ValueError, match="num_stages"):
        AQNConfig(enabled=True, total_steps=10, num_stages=1)
    with pytest.raises(ValueError, match="decay"):
        AQNConfig(enabled=True, total_steps=10, decay="step")
    with pytest.raises(ValueError, match="sigma_end > 0"):
        AQNConfig(enabled=True, total_steps=10, sigma_end=0.0)
    AQNConfig(enabled=True, total_steps=10, sigma_end=0.0, decay="linear")  # fine for a linear decay to 0
    assert aqn_sigma(AQNConfig(enabled=False), 123) == 0.0


def test_smallest_sigma_still_changes_bf16_logits(tiny_qwen2_dir):
    """The norms are float32 and the scale multiply is float32, so sigma = 1e-4 survives bf16."""
    import qerl_jax
    from qerl_jax.aqn import AQNConfig, apply_aqn

    path, _ = tiny_qwen2_dir
    config, params = qerl_jax.load_model(path, dtype="bfloat16")
    assert params["norms"]["final_norm"].dtype == jnp.float32
    cfg = AQNConfig(enabled=True, sigma_start=1e-4, sigma_end=1e-4, num_stages=3, decay="linear", total_steps=3)
    noisy = {**params, "norms": apply_aqn(cfg, params["norms"], jax.random.key(0), 2)}
    ids = jnp.arange(12, dtype=jnp.int32)[None] % config.vocab_size
    clean = qerl_jax.forward(config, params, ids)
    assert float(jnp.abs(qerl_jax.forward(config, noisy, ids) - clean).max()) > 0


def test_first_stage_noise_is_a_checked_config_field():
    from qerl_jax import run_config
    from qerl_jax.config import default_config
    from qerl_jax.validate import config_problems

    cfg = default_config()
    assert cfg.aqn.first_stage_noise is False
    cfg.aqn.first_stage_noise = None
    assert [p for p in config_problems(cfg) if p.startswith("aqn.")] == [
        "aqn.first_stage_noise = None: expected True or False, got None"
    ]
    cfg.aqn.first_stage_noise, cfg.model.quant = True, "nvfp4"
    assert run_config.from_config_dict(cfg).aqn.first_stage_noise is True
