"""LoRA pytree: PEFT-compatible init and scale, exact base logits at B = 0, trainability."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import make_hf_model

import qerl_jax
from qerl_jax.lora import LoraConfig, check_lora, init_lora, lora_scale, num_lora_params, projection_shapes
from qerl_jax.models.qwen2 import PROJECTIONS
from qerl_jax.optim import make_optimizer
from qerl_jax.rl.logprobs import token_logprobs


@pytest.fixture(scope="module")
def tiny(tiny_qwen2_dir):
    path, model = tiny_qwen2_dir
    config, params = qerl_jax.load_model(path, dtype="float32")
    return config, params, model


def test_zero_b_gives_exactly_the_base_logits(tiny):
    config, params, _ = tiny
    cfg = LoraConfig(rank=8, alpha=32.0)
    lora = init_lora(jax.random.key(0), config, cfg)
    ids = np.random.default_rng(0).integers(0, config.vocab_size, (2, 9)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[1, :3] = 0
    fwd = jax.jit(lambda p: qerl_jax.forward(config, p, ids, mask, lora_scale=lora_scale(cfg)))
    np.testing.assert_array_equal(np.asarray(fwd({**params, "lora": lora})), np.asarray(fwd(params)))
    bumped = jax.tree.map(lambda x: x + 0.01, lora)  # and B != 0 does change them
    assert np.abs(np.asarray(fwd({**params, "lora": bumped})) - np.asarray(fwd(params))).max() > 1e-3


@pytest.mark.parametrize("rslora", [False, True])
def test_init_and_scale_match_peft(tiny, rslora):
    import peft

    config, _, _ = tiny
    rank, alpha = 8, 16.0
    cfg = LoraConfig(rank=rank, alpha=alpha, rslora=rslora)
    lora = init_lora(jax.random.key(1), config, cfg)
    hf = make_hf_model(seed=3)
    pm = peft.get_peft_model(
        hf,
        peft.LoraConfig(
            r=rank, lora_alpha=alpha, target_modules=list(PROJECTIONS), use_rslora=rslora, lora_dropout=0.0
        ),
    )
    shapes = projection_shapes(config)
    seen = set()
    for name, module in pm.named_modules():
        proj = name.rsplit(".", 1)[-1]
        if proj not in PROJECTIONS or not hasattr(module, "lora_A"):
            continue
        layer = int(name.split(".layers.")[1].split(".")[0])
        a_ref = module.lora_A["default"].weight.detach().numpy()  # [r, K]
        b_ref = module.lora_B["default"].weight.detach().numpy()  # [N, r]
        a, b = np.asarray(lora["layers"][proj]["a"][layer]), np.asarray(lora["layers"][proj]["b"][layer])
        assert a.shape == a_ref.shape and b.shape == b_ref.shape
        assert (b_ref.shape[0], a_ref.shape[1]) == shapes[proj]
        assert not b.any() and not b_ref.any()
        bound = 1 / np.sqrt(a.shape[1])
        assert np.abs(a).max() <= bound and np.abs(a_ref).max() <= bound * (1 + 1e-6)
        assert module.scaling["default"] == pytest.approx(lora_scale(cfg))
        seen.add((proj, layer))
    assert len(seen) == len(PROJECTIONS) * config.num_hidden_layers
    # Same distribution as PEFT (uniform on +-1/sqrt(K): std = bound / sqrt(3)); layers drawn independently.
    a = np.asarray(lora["layers"]["down_proj"]["a"])
    assert abs(a.std() * np.sqrt(3) * np.sqrt(a.shape[-1]) - 1) < 0.05
    assert not np.allclose(a[0], a[1])


def test_scale_and_targets():
    assert lora_scale(LoraConfig(rank=16, alpha=32)) == 2.0
    assert lora_scale(LoraConfig(rank=16, alpha=32, rslora=True)) == 8.0
    cfg = LoraConfig(rank=2, targets=("down_proj", "q_proj"))
    config = qerl_jax.ModelConfig(
        vocab_size=10,
        hidden_size=8,
        intermediate_size=12,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=4,
    )
    lora = init_lora(jax.random.key(0), config, cfg)
    assert sorted(lora["layers"]) == ["down_proj", "q_proj"]
    assert lora["layers"]["down_proj"]["a"].shape == (3, 2, 12) and lora["layers"]["down_proj"]["b"].shape == (3, 8, 2)
    assert num_lora_params(lora) == 3 * (2 * 12 + 8 * 2 + 2 * 8 + 8 * 2)
    assert check_lora(lora, config) == 2
    # The draw of a projection does not depend on which other projections are targeted.
    alone = init_lora(jax.random.key(0), config, LoraConfig(rank=2, targets=("down_proj",)))
    np.testing.assert_array_equal(
        np.asarray(alone["layers"]["down_proj"]["a"]), np.asarray(lora["layers"]["down_proj"]["a"])
    )
    bad = {"layers": {"q_proj": {"a": jnp.zeros((3, 2, 8)), "b": jnp.zeros((3, 4, 2))}}}  # q out is 8, not 4
    with pytest.raises(ValueError, match="q_proj"):
        check_lora(bad, config)


def test_config_errors():
    with pytest.raises(ValueError, match="empty"):
        LoraConfig(targets=())
    with pytest.raises(ValueError, match="unknown projection"):
        LoraConfig(targets=("q_proj", "qkv_proj"))
    with pytest.raises(ValueError, match="dropout"):
        LoraConfig(dropout=0.05)
    with pytest.raises(ValueError, match="rank"):
        LoraConfig(rank=0)
    with pytest.raises(ValueError, match="string"):
        LoraConfig(targets="q_proj")


def test_sft_steps_lower_the_loss_and_touch_only_lora(tiny):
    config, params, _ = tiny
    cfg = LoraConfig(rank=8, alpha=16.0)
    lora = init_lora(jax.random.key(0), config, cfg)
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, config.vocab_size, (4, 12)), jnp.int32)
    mask = jnp.ones_like(ids)
    base_copy = jax.tree.map(np.array, params)

    def nll(lo, frozen):
        lp, _ = token_logprobs(config, {**frozen, "lora": lo}, ids, mask, lora_scale=lora_scale(cfg), chunk_size=4)
        return -lp.mean()

    opt = make_optimizer(1e-2, warmup_steps=0, total_steps=20, schedule="constant", clip_norm=1.0, weight_decay=0.0)

    @jax.jit
    def step(lo, opt_state, frozen):
        loss, (g_lora, g_frozen) = jax.value_and_grad(nll, argnums=(0, 1))(lo, frozen)
        updates, opt_state = opt.update(g_lora, opt_state, lo)
        return optax.apply_updates(lo, updates), opt_state, loss, g_frozen

    opt_state = opt.init(lora)
    losses = []
    for _ in range(6):
        lora, opt_state, loss, g_frozen = step(lora, opt_state, params)
        losses.append(float(loss))
    assert losses[-1] < losses[0] - 0.1, losses
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    # The frozen weights do receive gradients in this test, but nothing ever applies them.
    assert float(jnp.abs(g_frozen["norms"]["final_norm"]).max()) > 0
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(base_copy)):
        np.testing.assert_array_equal(np.asarray(a), b)
