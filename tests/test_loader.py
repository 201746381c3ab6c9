"""Loader: the checkpoint layout it produces and the errors it gives on bad input."""

import json
import os
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import qerl_jax
from qerl_jax.model_io.loader import CheckpointError


@pytest.fixture
def ckpt(tmp_path, tiny_qwen2_dir):
    path, _ = tiny_qwen2_dir
    dst = tmp_path / "ckpt"
    shutil.copytree(path, dst)
    return str(dst)


def _edit_config(path, **changes):
    cfg_file = os.path.join(path, "config.json")
    cfg = json.load(open(cfg_file))
    cfg.update(changes)
    json.dump(cfg, open(cfg_file, "w"))


def _edit_weights(path, fn):
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    fn(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def test_layout_is_stacked_and_split_into_base_and_norms(tiny_qwen2_dir):
    path, model = tiny_qwen2_dir
    config, params = qerl_jax.load_model(path, dtype="float32")
    assert set(params) == {"base", "norms"}
    layers = params["base"]["layers"]
    L, D = config.num_hidden_layers, config.hidden_size
    assert layers["q_proj"]["w"].shape == (L, config.num_attention_heads * config.head_dim, D)
    assert layers["k_proj"]["b"].shape == (L, config.num_key_value_heads * config.head_dim)
    assert layers["down_proj"]["w"].shape == (L, D, config.intermediate_size)
    assert params["norms"]["layers"]["input_layernorm"].shape == (L, D)
    want = model.model.layers[1].mlp.up_proj.weight.detach().numpy()
    np.testing.assert_array_equal(np.asarray(layers["up_proj"]["w"][1]), want)
    want_norm = model.model.layers[1].post_attention_layernorm.weight.detach().numpy()
    np.testing.assert_array_equal(np.asarray(params["norms"]["layers"]["post_attention_layernorm"][1]), want_norm)


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        qerl_jax.load_model(str(tmp_path / "nope"))


def test_missing_config(ckpt):
    os.remove(os.path.join(ckpt, "config.json"))
    with pytest.raises(CheckpointError, match="config.json"):
        qerl_jax.load_model(ckpt)


def test_unsupported_model_type(ckpt):
    _edit_config(ckpt, model_type="gpt2", architectures=["GPT2LMHeadModel"])
    with pytest.raises(CheckpointError, match="model_type 'gpt2'"):
        qerl_jax.load_model(ckpt)


def test_unsupported_architecture(ckpt):
    _edit_config(ckpt, architectures=["Qwen2ForSequenceClassification"])
    with pytest.raises(CheckpointError, match="architectures"):
        qerl_jax.load_model(ckpt)


def test_unsupported_rope_scaling(ckpt):
    _edit_config(ckpt, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6})
    with pytest.raises(ValueError, match="rope_scaling type 'yarn'"):
        config, params = qerl_jax.load_model(ckpt)
        qerl_jax.forward(config, params, np.zeros((1, 2), np.int32))


def test_missing_config_field(ckpt):
    cfg_file = os.path.join(ckpt, "config.json")
    cfg = json.load(open(cfg_file))
    del cfg["hidden_size"]
    json.dump(cfg, open(cfg_file, "w"))
    with pytest.raises(CheckpointError, match="'hidden_size'"):
        qerl_jax.load_model(ckpt)


def test_missing_tensor(ckpt):
    _edit_weights(ckpt, lambda t: t.pop("model.layers.1.mlp.gate_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing 1 tensor.*layers\.1\.mlp\.gate_proj\.weight"):
        qerl_jax.load_model(ckpt)


def test_wrong_shape(ckpt):
    def shrink(t):
        t["model.layers.0.self_attn.k_proj.weight"] = t["model.layers.0.self_attn.k_proj.weight"][:-1]

    _edit_weights(ckpt, shrink)
    with pytest.raises(CheckpointError, match=r"k_proj\.weight' has shape \(31, 64\), expected \(32, 64\)"):
        qerl_jax.load_model(ckpt)


def test_pickle_checkpoint_is_refused(ckpt):
    os.remove(os.path.join(ckpt, "model.safetensors"))
    open(os.path.join(ckpt, "pytorch_model.bin"), "wb").write(b"not loaded")
    with pytest.raises(CheckpointError, match="safetensors only"):
        qerl_jax.load_model(ckpt)


def test_missing_shard_named(tmp_path, tiny_qwen2_dir):
    from conftest import save_hf_model

    _, model = tiny_qwen2_dir
    path = save_hf_model(model, tmp_path / "sharded", shard_size="20KB")
    index = json.load(open(os.path.join(path, "model.safetensors.index.json")))
    victim = sorted(set(index["weight_map"].values()))[-1]
    os.remove(os.path.join(path, victim))
    with pytest.raises(CheckpointError, match=victim):
        qerl_jax.load_model(path)


def test_unknown_dtype(tiny_qwen2_dir):
    with pytest.raises(ValueError, match="dtype 'int8'"):
        qerl_jax.load_model(tiny_qwen2_dir[0], dtype="int8")


def test_tokenizer_missing_is_clear(ckpt):
    with pytest.raises(CheckpointError, match="tokenizer"):
        qerl_jax.load_tokenizer(ckpt)
