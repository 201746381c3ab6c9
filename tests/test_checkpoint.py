"""Orbax checkpoints: exact round trip of the train state, PRNG key and metadata."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from qerl_jax.checkpoint import Checkpointer


def _state(seed):
    k = jax.random.key(seed)
    lora = {"layers": {"q_proj": {"a": jax.random.normal(k, (2, 4, 8)), "b": jnp.zeros((2, 6, 4))}}}
    opt = optax.adamw(1e-3)
    return {
        "lora": lora,
        "opt_state": opt.init(lora),
        "step": jnp.asarray(7, jnp.int32),
        "key": jax.random.key(seed + 1),
    }


def test_round_trip_is_exact(tmp_path):
    ckpt = Checkpointer(str(tmp_path / "ckpt"))
    state = _state(0)
    meta = {"loader": {"epoch": 1, "position": 12}, "config": {"lr": 1e-5}}
    ckpt.save(7, state, meta)
    assert ckpt.latest_step() == 7
    restored, restored_meta = Checkpointer(str(tmp_path / "ckpt")).restore(None, like=_state(5))
    assert restored_meta == meta
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
        if jax.dtypes.issubdtype(want.dtype, jax.dtypes.prng_key):
            np.testing.assert_array_equal(jax.random.key_data(got), jax.random.key_data(want))
        else:
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert jax.tree.structure(restored) == jax.tree.structure(state)


def test_keeps_latest_and_prunes(tmp_path):
    ckpt = Checkpointer(str(tmp_path / "ckpt"), max_to_keep=2)
    for step in (1, 2, 3):
        ckpt.save(step, _state(step), {"step": step})
    assert ckpt.latest_step() == 3
    assert sorted(ckpt._manager.all_steps()) == [2, 3]
    _, meta = ckpt.restore(2, like=_state(0))
    assert meta == {"step": 2}


def test_restore_without_checkpoint_is_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        Checkpointer(str(tmp_path / "empty")).restore(None, like=_state(0))
