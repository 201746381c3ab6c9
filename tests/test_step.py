"""The jitted train step and the optimizer: alignment, LoRA-only updates, accumulation, NaN skips."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import qerl_jax
from qerl_jax.lora import LoraConfig, init_lora, lora_scale
from qerl_jax.optim import make_optimizer, make_schedule
from qerl_jax.rl.logprobs import to_token_aligned, token_logprobs
from qerl_jax.rl.losses import LossConfig, policy_loss
from qerl_jax.rl.packing import pack_batch, to_sequence_layout
from qerl_jax.rl.step import NonFiniteError, TrainStep, check_nonfinite, init_train_state

pytestmark = pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")

LCFG = LoraConfig(rank=4, alpha=8.0, targets=("q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"))
SCALE = lora_scale(LCFG)
DAPO = LossConfig(kind="dapo", eps_low=0.2, eps_high=0.28)
B, T = 4, 12
LR = 0.5


@pytest.fixture(scope="module")
def setup(tiny_qwen2_dir):
    path, _ = tiny_qwen2_dir
    config, params = qerl_jax.load_model(path, dtype="float32")
    lora = init_lora(jax.random.key(0), config, LCFG)
    keys = iter(jax.random.split(jax.random.key(1), 32))
    lora = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(next(keys), x.shape), lora)  # B != 0
    rng = np.random.default_rng(0)
    ids = rng.integers(0, config.vocab_size, (B, T)).astype(np.int32)
    attn = np.ones((B, T), np.int32)
    attn[1, :3] = 0  # left padding (prompt)
    attn[2, -2:] = 0  # right padding (short response)
    ids[attn == 0] = 0
    resp = np.zeros((B, T), np.float32)
    resp[:, 6:] = 1
    resp[attn == 0] = 0
    # SGD with momentum: the first update is exactly -LR * grad, so gradients can be compared tightly
    # (Adam's g / (|g| + eps) amplifies rounding for tiny gradients); make_optimizer is tested in test_optim.py.
    opt = optax.sgd(LR, momentum=0.9)
    return config, params, lora, ids, attn, resp, opt


_LOGP = {}


def _logp_fn(config, params):
    """Jitted next-token log-probs under a LoRA (compiled once per module)."""
    if "fn" not in _LOGP:
        _LOGP["fn"] = jax.jit(
            lambda lo, i, m: token_logprobs(config, {**params, "lora": lo}, i, m, lora_scale=SCALE)[0]
        )
    return _LOGP["fn"]


def _batch(setup, noise=0.3, adv=(1.0, -0.7, 0.4, -1.2)):
    config, params, lora, ids, attn, resp, _ = setup
    logp = np.asarray(to_token_aligned(_logp_fn(config, params)(lora, ids, attn)))
    old = (logp + np.random.default_rng(1).normal(0, noise, logp.shape)) * resp
    return dict(
        input_ids=ids,
        attention_mask=attn,
        response_mask=resp,
        old_logp=old.astype(np.float32),
        advantages=np.array(adv, np.float32),
    )


_STEPS = {}


def _packed(step, micro, row_len):
    """The step on the packed form of a padded batch (the references below are padded computations)."""

    def run(state, params, batch, ref_logp=None):
        packed = pack_batch(batch, row_len, rows_multiple=micro or 1)
        if ref_logp is not None:
            ref_logp = to_sequence_layout(ref_logp, batch["attention_mask"], row_len)
        return step(state, params, packed, ref_logp=ref_logp)

    return run


def _train_step(setup, loss_cfg=DAPO, micro=None, remat=False, chunk=None, attention="xla") -> TrainStep:
    """One TrainStep per setting for the whole module (each compiles its programs once)."""
    key = (loss_cfg, micro, remat, chunk, attention)
    if key not in _STEPS:
        config, *_, opt = setup
        _STEPS[key] = TrainStep(
            config,
            loss_cfg,
            opt,
            lora_scale=SCALE,
            remat=remat,
            attention=attention,
            micro_batch_size=micro,
            logprob_chunk=chunk,
            lr_schedule=make_schedule(LR, warmup_steps=0, total_steps=10, schedule="constant"),
        )
    return _STEPS[key]


def _step(setup, loss_cfg=DAPO, micro=None, remat=False, chunk=None, attention="xla", row_len=2 * T):
    return _packed(_train_step(setup, loss_cfg, micro, remat, chunk, attention), micro, row_len)


def test_on_policy_batch_has_unit_ratio(setup):
    """old_logp built token-aligned by hand from the model's logits: the step must see ratio 1."""
    config, params, lora, ids, attn, resp, opt = setup
    logits = np.asarray(
        jax.jit(lambda p: qerl_jax.forward(config, p, ids, attn, lora_scale=SCALE))({**params, "lora": lora})
    )
    logits = logits.astype(np.float64)
    old = np.zeros((B, T), np.float32)
    for b in range(B):
        for t in range(1, T):  # the token at t was sampled from the distribution at t - 1
            row = logits[b, t - 1]
            old[b, t] = (row[ids[b, t]] - row.max() - np.log(np.exp(row - row.max()).sum())) * resp[b, t]
    batch = dict(
        input_ids=ids,
        attention_mask=attn,
        response_mask=resp,
        old_logp=old,
        advantages=np.array([1.0, -0.7, 0.4, -1.2], np.float32),
    )
    _, m = _step(setup)(init_train_state(lora, opt), params, batch)
    assert abs(float(m["ratio_max"]) - 1) < 1e-4 and abs(float(m["ratio_min"]) - 1) < 1e-4
    assert float(m["clip_frac"]) == 0 and float(m["response_tokens"]) == resp.sum()


def test_step_equals_direct_update_and_touches_only_lora(setup):
    config, params, lora, ids, attn, resp, opt = setup
    batch = _batch(setup)
    frozen_before = jax.tree.map(np.array, params)
    new_state, m = _step(setup)(init_train_state(lora, opt), params, batch)

    def direct_loss(lo):  # the shift written out by hand: logp[:, t] scores token t + 1
        lp = _logp_fn(config, params)(lo, ids, attn)
        return policy_loss(
            lp, jnp.asarray(batch["old_logp"][:, 1:]), jnp.asarray(batch["advantages"]), jnp.asarray(resp[:, 1:]), DAPO
        )

    (loss, dm), grads = jax.value_and_grad(direct_loss, has_aux=True)(lora)
    for new, old, g in zip(jax.tree.leaves(new_state.lora), jax.tree.leaves(lora), jax.tree.leaves(grads)):
        step_grad = (np.asarray(old) - np.asarray(new)) / LR
        # atol: recovering the gradient from float32 params costs ~ulp(param) / LR
        np.testing.assert_allclose(step_grad, np.asarray(g), atol=1e-7, rtol=1e-4)
    assert any(
        not np.allclose(np.asarray(a), np.asarray(b))
        for a, b in zip(jax.tree.leaves(new_state.lora), jax.tree.leaves(lora))
    )
    np.testing.assert_allclose(float(m["loss"]), float(loss), rtol=1e-5)
    np.testing.assert_allclose(float(m["grad_norm"]), float(optax.global_norm(grads)), rtol=1e-5)
    assert 0 < float(m["clip_frac"]) < 1 and float(m["clip_frac"]) == pytest.approx(float(dm["clip_frac"]))
    assert int(new_state.step) == 1 and float(m["skipped"]) == 0 and float(m["lr"]) == pytest.approx(LR)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(frozen_before)):  # base and norms bit-identical
        np.testing.assert_array_equal(np.asarray(a), b)


def test_micro_batches_remat_and_chunks_give_the_full_batch_update(setup):
    _, params, lora, *_, opt = setup
    batch = _batch(setup)
    full_state, full_m = _step(setup)(init_train_state(lora, opt), params, batch)
    micro_state, micro_m = _step(setup, micro=2, remat=True, chunk=4)(init_train_state(lora, opt), params, batch)
    for a, b, old in zip(jax.tree.leaves(micro_state.lora), jax.tree.leaves(full_state.lora), jax.tree.leaves(lora)):
        g_full = np.asarray(old) - np.asarray(b)
        np.testing.assert_allclose(np.asarray(old) - np.asarray(a), g_full, atol=1e-7, rtol=1e-4)
    for k in ("loss", "grad_norm", "clip_frac", "entropy", "approx_kl", "ratio_max"):
        np.testing.assert_allclose(float(micro_m[k]), float(full_m[k]), rtol=1e-5, err_msg=k)


@pytest.fixture(scope="module")
def packed_params(tiny_qwen2_dir):
    return qerl_jax.load_model(tiny_qwen2_dir[0], dtype="float32", quant="nvfp4")[1]


@pytest.mark.parametrize("base", ["dense", "nvfp4"])
@pytest.mark.parametrize("attention, remat", [("flash", "none"), ("flash", "full"), ("flash", "proj"), ("xla", "proj")])
def test_flash_attention_and_remat_modes_keep_the_loss_and_lora_grads(setup, packed_params, base, attention, remat):
    """The train step's fast paths compute the reference step's function: same loss, same update."""
    _, params, lora, *_, opt = setup
    params = packed_params if base == "nvfp4" else params
    batch = _batch(setup)  # row 1 left-padded, row 2 right-padded
    ref_state, ref_m = _step(setup, micro=2, chunk=4)(init_train_state(lora, opt), params, batch)
    state, m = _step(setup, micro=2, chunk=4, remat=remat, attention=attention)(
        init_train_state(lora, opt), params, batch
    )
    for a, b, old in zip(jax.tree.leaves(state.lora), jax.tree.leaves(ref_state.lora), jax.tree.leaves(lora)):
        np.testing.assert_allclose(
            np.asarray(old) - np.asarray(a), np.asarray(old) - np.asarray(b), atol=1e-7, rtol=1e-4
        )
    for k in ("loss", "grad_norm", "clip_frac", "entropy", "approx_kl"):
        np.testing.assert_allclose(float(m[k]), float(ref_m[k]), rtol=1e-5, err_msg=k)
    assert float(ref_m["grad_norm"]) > 0


def test_packing_rejects_masks_with_holes(setup):
    batch = _batch(setup)
    holed = dict(batch, attention_mask=batch["attention_mask"].copy(), response_mask=batch["response_mask"].copy())
    holed["attention_mask"][3, 4] = 0
    holed["response_mask"][3, 4] = 0
    with pytest.raises(ValueError, match=r"rows \[3\] have padding between real tokens"):
        pack_batch(holed, 2 * T)


@pytest.mark.parametrize(
    "kind,source", [("grpo", "rollout"), ("dapo", "rollout"), ("gspo", "rollout"), ("cispo", "proximal")]
)
def test_one_long_and_many_short_sequences_give_the_padded_update(setup, kind, source):
    """A long-tailed batch (one full-length sequence, many short ones, empty filler rows) packed into
    few rows over several micro-steps: loss, LoRA gradients and metrics of the padded computation
    (gspo: its per-sequence ratio; cispo with the decoupled loss's behaviour weight)."""
    config, params, lora, *_, opt = setup
    wide = dict(gspo_eps_low=0.2, gspo_eps_high=0.28)  # the random old_logp is far from the policy
    loss_cfg = LossConfig(kind=kind, eps_low=0.2, eps_high=0.28, old_logp_source=source, **wide)
    rng = np.random.default_rng(3)
    n, width = 10, 16
    lengths = np.array([16, 4, 3, 5, 4, 3, 6, 4, 0, 0])  # two filler sequences with no tokens
    attn = (np.arange(width)[None] >= width - lengths[:, None]).astype(np.int32)  # left-aligned prompts padded left
    ids = rng.integers(0, config.vocab_size, (n, width)).astype(np.int32) * attn
    resp = attn * (np.arange(width)[None] >= width - lengths[:, None] + 2)
    resp = resp.astype(np.float32)
    old = np.where(resp > 0, rng.normal(-2.0, 0.5, (n, width)), 0.0).astype(np.float32)
    adv = rng.normal(0, 1, n).astype(np.float32)
    adv[8:] = 0
    batch = dict(input_ids=ids, attention_mask=attn, response_mask=resp, old_logp=old, advantages=adv)
    packed = pack_batch(batch, width, rows_multiple=1)
    assert packed["input_ids"].shape[0] == 3  # 16 | 6+5+4 | 4+4+3+3 (first-fit decreasing)
    step = TrainStep(config, loss_cfg, opt, lora_scale=SCALE, remat=False, micro_batch_size=1)
    state, m = step(init_train_state(lora, opt), params, packed)

    def direct_loss(lo):  # the padded batch, one sequence per row (jit: a fresh forward per call)
        lp = jax.jit(lambda lo_: token_logprobs(config, {**params, "lora": lo_}, ids, attn, lora_scale=SCALE))(lo)
        return policy_loss(lp[0], old[:, 1:], adv, resp[:, 1:], loss_cfg, entropy=lp[1])

    (loss, dm), grads = jax.value_and_grad(direct_loss, has_aux=True)(lora)
    for new, old_, g in zip(jax.tree.leaves(state.lora), jax.tree.leaves(lora), jax.tree.leaves(grads)):
        np.testing.assert_allclose((np.asarray(old_) - np.asarray(new)) / LR, np.asarray(g), atol=1e-7, rtol=1e-4)
    np.testing.assert_allclose(float(m["loss"]), float(loss), rtol=1e-5)
    for k in ("pg_loss", "clip_frac", "entropy", "approx_kl", "ratio_min", "ratio_max", "adv_mean", "adv_std",
              "response_tokens", "sampler_abs_log_ratio"):
        np.testing.assert_allclose(float(m[k]), float(dm[k]), rtol=1e-5, atol=1e-7, err_msg=k)
    assert float(m["grad_norm"]) > 0


def test_nonfinite_batches_are_skipped_and_counted(setup):
    _, params, lora, *_, opt = setup
    step = _step(setup)
    state = init_train_state(lora, opt)
    before = jax.tree.map(np.array, state)
    bad = _batch(setup, adv=(1.0, np.nan, 0.4, -1.2))
    for i in (1, 2):
        state, m = step(state, params, bad)
        assert float(m["skipped"]) == 1 and int(m["consecutive_skips"]) == i
        for a, b in zip(
            jax.tree.leaves(state.lora) + jax.tree.leaves(state.opt_state),
            jax.tree.leaves(before.lora) + jax.tree.leaves(before.opt_state),
        ):
            np.testing.assert_array_equal(np.asarray(a), b)
    check_nonfinite(state, max_consecutive=3)  # 2 < 3: fine
    with pytest.raises(NonFiniteError, match="2 consecutive train steps"):
        check_nonfinite(state, max_consecutive=2)
    state, m = step(state, params, _batch(setup))
    assert float(m["skipped"]) == 0 and int(state.consecutive_skips) == 0 and int(state.total_skips) == 2
    assert int(state.step) == 1


def test_kl_reference_is_the_base_without_lora(setup):
    config, params, lora, ids, attn, resp, opt = setup
    grpo = LossConfig(kind="grpo", eps_low=0.2, eps_high=0.2, beta=0.1)
    batch = _batch(setup)
    step = _step(setup, loss_cfg=grpo)
    _, m_inner = step(init_train_state(lora, opt), params, batch)
    ref = np.asarray(jax.jit(lambda: token_logprobs(config, params, ids, attn)[0])(), np.float64)  # no "lora" key
    logp = np.asarray(_logp_fn(config, params)(lora, ids, attn), np.float64)
    d = (ref - logp)[resp[:, 1:] > 0]
    assert float(m_inner["kl_ref"]) > 1e-4
    np.testing.assert_allclose(float(m_inner["kl_ref"]), np.mean(np.exp(d) - d - 1), rtol=1e-4)
    # A given ref_logp (token-aligned) replaces the inner forward: the policy itself as reference gives KL 0.
    own = np.asarray(to_token_aligned(jnp.asarray(logp, jnp.float32)))
    _, m_given = step(init_train_state(lora, opt), params, batch, ref_logp=own)
    assert abs(float(m_given["kl_ref"])) < 1e-6


def test_bad_batches_are_rejected(setup):
    _, params, lora, *_, opt = setup
    step = _train_step(setup, micro=2, remat=True, chunk=4)
    good = pack_batch(_batch(setup), 2 * T, rows_multiple=2)
    state = init_train_state(lora, opt)
    cases = {
        "old_logp": dict(good, old_logp=good["old_logp"][:, :-1]),
        "segment_ids": dict(good, segment_ids=good["segment_ids"][:, :-1]),
        "missing": {k: v for k, v in good.items() if k != "response_mask"},
        "micro_batch_size": dict(good, input_ids=good["input_ids"][:1], segment_ids=good["segment_ids"][:1]),
        "position 0": dict(good, response_mask=np.ones_like(good["response_mask"])),
        "past their sequence's end": dict(good, response_mask=(good["token_index"] < 0).astype(np.float32)),
        "ref_logp": None,
    }
    for what, batch in cases.items():
        with pytest.raises(ValueError, match=what):
            if what == "ref_logp":
                step(state, params, good, ref_logp=np.zeros((B, 2 * T + 1), np.float32))
            else:
                step(state, params, batch)


def test_trained_norms_step_equals_direct_update_over_micro_batches(setup):
    """With trained norms the step's update of LoRA and norms is -LR * the direct gradient of both
    (accumulated over micro-batches); the final norm and the frozen params stay as they were."""
    from qerl_jax.lora import init_trained_norms, with_lora

    config, params, lora, ids, attn, resp, opt = setup
    batch = _batch(setup)
    frozen_before = jax.tree.map(np.array, params)
    norms = init_trained_norms(params["norms"])
    norms = jax.tree.map(lambda w: w + 0.05 * jax.random.normal(jax.random.key(5), w.shape), norms)
    assert set(norms["layers"]) == {"input_layernorm", "post_attention_layernorm"}
    state, m = _step(setup, micro=2, chunk=4)(init_train_state(lora, opt, norms), params, batch)

    def direct_loss(trainable):
        lp = jax.jit(lambda t: token_logprobs(config, with_lora(params, *t), ids, attn, lora_scale=SCALE)[0])(trainable)
        return policy_loss(lp, batch["old_logp"][:, 1:], batch["advantages"], resp[:, 1:], DAPO)

    (loss, _), grads = jax.value_and_grad(direct_loss, has_aux=True)((lora, norms))
    leaves = jax.tree.leaves
    for new, old, g in zip(leaves((state.lora, state.norms)), leaves((lora, norms)), leaves(grads)):
        np.testing.assert_allclose((np.asarray(old) - np.asarray(new)) / LR, np.asarray(g), atol=1e-6, rtol=1e-4)
    assert min(float(np.abs(np.asarray(g)).max()) for g in jax.tree.leaves(grads[1])) > 1e-4  # norms do move
    np.testing.assert_allclose(float(m["loss"]), float(loss), rtol=1e-5)
    np.testing.assert_allclose(float(m["grad_norm"]), float(optax.global_norm(grads)), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(frozen_before)):  # base and frozen norms untouched
        np.testing.assert_array_equal(np.asarray(a), b)
    assert _step(setup)(init_train_state(lora, opt), params, batch)[0].norms is None  # off: nothing trains them


def test_weight_decay_leaves_trained_norms_alone(setup):
    """lr > 0, weight decay 0.1, zero gradient (all advantages 0): AdamW decays the LoRA by
    (1 - lr * wd) exactly and leaves the norm scales unchanged (transformers' Trainer excludes norms)."""
    from qerl_jax.lora import init_trained_norms

    config, params, lora, *_ = setup
    lr, wd = 0.1, 0.1
    adamw = make_optimizer(lr, warmup_steps=0, total_steps=10, schedule="constant", weight_decay=wd, clip_norm=0.2)
    norms = init_trained_norms(params["norms"])
    step = TrainStep(config, DAPO, adamw, lora_scale=SCALE, remat=False)
    state, m = _packed(step, None, 2 * T)(
        init_train_state(lora, adamw, norms), params, _batch(setup, adv=(0.0, 0.0, 0.0, 0.0))
    )
    assert float(m["grad_norm"]) == 0 and float(m["skipped"]) == 0
    for a, b in zip(jax.tree.leaves(state.norms), jax.tree.leaves(norms)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(jax.tree.leaves(state.lora), jax.tree.leaves(lora)):
        np.testing.assert_allclose(np.asarray(a), (1 - lr * wd) * np.asarray(b), rtol=1e-6, atol=1e-9)
    assert any(np.abs(np.asarray(b)).max() > 0.01 for b in jax.tree.leaves(lora))
