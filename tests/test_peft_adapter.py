"""PEFT export: our LoRA pytree, saved in PEFT's format, gives the same logits under transformers+peft."""

import copy
import json
import os

import numpy as np
import pytest
import torch

import qerl_jax
from qerl_jax.model_io.peft_adapter import export_peft_adapter


def _random_lora(config, params, rank, targets, seed=0):
    rng = np.random.default_rng(seed)
    layers = {}
    for proj in targets:
        L, n, k = params["base"]["layers"][proj]["w"].shape
        layers[proj] = {
            "a": rng.normal(0, 0.2, (L, rank, k)).astype(np.float32),
            "b": rng.normal(0, 0.2, (L, n, rank)).astype(np.float32),
        }
    return {"layers": layers}


@pytest.mark.parametrize("rslora", [False, True])
def test_peft_adapter_reproduces_our_logits(tmp_path, tiny_qwen2_dir, rslora):
    from peft import PeftModel

    path, model = tiny_qwen2_dir
    config, params = qerl_jax.load_model(path, dtype="float32")
    rank, alpha = 4, 8.0
    targets = ("q_proj", "v_proj", "o_proj", "down_proj")
    lora = _random_lora(config, params, rank, targets)
    scale = alpha / (rank**0.5 if rslora else rank)
    out = export_peft_adapter(lora, str(tmp_path / "adapter"), rank=rank, alpha=alpha, rslora=rslora)
    assert json.load(open(os.path.join(out, "adapter_config.json")))["target_modules"] == sorted(targets)

    ids = np.random.default_rng(1).integers(0, config.vocab_size, (2, 9)).astype(np.int32)
    ours = np.asarray(qerl_jax.forward(config, {**params, "lora": lora}, ids, lora_scale=scale))
    peft_model = PeftModel.from_pretrained(model, out).eval()
    try:
        with torch.no_grad():
            ref = peft_model(input_ids=torch.tensor(ids, dtype=torch.long)).logits.numpy()
    finally:
        peft_model.unload()  # restores the shared session model without the adapter
    base = np.asarray(qerl_jax.forward(config, params, ids))
    assert np.abs(ref - base).max() > 1e-2  # the adapter really changes the logits
    np.testing.assert_allclose(ours, ref, atol=2e-4 * np.abs(ref).max())


def test_empty_lora_is_refused(tmp_path):
    with pytest.raises(ValueError, match="empty LoRA"):
        export_peft_adapter({"layers": {}}, str(tmp_path), rank=4, alpha=4)


def test_load_round_trip(tmp_path, tiny_qwen2_dir):
    from qerl_jax.model_io.peft_adapter import load_peft_adapter

    path, _ = tiny_qwen2_dir
    config, params = qerl_jax.load_model(path, dtype="float32")
    lora = _random_lora(config, params, 4, ("k_proj", "up_proj"))
    out = export_peft_adapter(lora, str(tmp_path / "a"), rank=4, alpha=8.0)
    loaded, adapter_cfg = load_peft_adapter(out, config.num_hidden_layers)
    assert adapter_cfg["r"] == 4 and adapter_cfg["lora_alpha"] == 8.0
    for proj in ("k_proj", "up_proj"):
        for part in ("a", "b"):
            np.testing.assert_array_equal(loaded["layers"][proj][part], lora["layers"][proj][part])


def test_trained_norms_export_as_modules_to_save_and_reload(tmp_path, tiny_qwen2_dir):
    """LoRA + trained norm scales, exported with modules_to_save: transformers + peft reproduce our
    logits, and load_peft_norms / load_peft_adapter read back what was written."""
    from peft import PeftModel
    from safetensors.numpy import load_file

    from qerl_jax.lora import init_trained_norms, with_lora
    from qerl_jax.model_io.peft_adapter import load_peft_adapter, load_peft_norms

    path, model = tiny_qwen2_dir
    config, params = qerl_jax.load_model(path, dtype="float32")
    lora = _random_lora(config, params, 4, ("q_proj", "up_proj"))
    rng = np.random.default_rng(3)
    norms = {"layers": {k: np.asarray(w) + rng.normal(0, 0.3, w.shape).astype(np.float32)
                        for k, w in init_trained_norms(params["norms"])["layers"].items()}}
    out = export_peft_adapter(lora, str(tmp_path / "adapter"), rank=4, alpha=8.0, norms=norms)
    assert json.load(open(os.path.join(out, "adapter_config.json")))["modules_to_save"] == [
        "input_layernorm",
        "post_attention_layernorm",
    ]
    keys = set(load_file(os.path.join(out, "adapter_model.safetensors")))
    assert "base_model.model.model.layers.1.post_attention_layernorm.weight" in keys  # PEFT's own save name

    ids = np.random.default_rng(1).integers(0, config.vocab_size, (2, 9)).astype(np.int32)
    ours = np.asarray(qerl_jax.forward(config, with_lora(params, lora, norms), ids, lora_scale=2.0))
    lora_only = np.asarray(qerl_jax.forward(config, with_lora(params, lora), ids, lora_scale=2.0))
    # A copy: peft's unload() keeps the modules_to_save copies, which would leak into the session model.
    peft_model = PeftModel.from_pretrained(copy.deepcopy(model), out).eval()
    with torch.no_grad():
        ref = peft_model(input_ids=torch.tensor(ids, dtype=torch.long)).logits.numpy()
    assert np.abs(ref - lora_only).max() > 1e-2  # the trained norms really change the logits
    np.testing.assert_allclose(ours, ref, atol=2e-4 * np.abs(ref).max())

    loaded = load_peft_norms(out, config.num_hidden_layers)
    for name in norms["layers"]:
        np.testing.assert_array_equal(loaded["layers"][name], norms["layers"][name])
    loaded_lora, _ = load_peft_adapter(out, config.num_hidden_layers)
    np.testing.assert_array_equal(loaded_lora["layers"]["up_proj"]["b"], lora["layers"]["up_proj"]["b"])
    plain = export_peft_adapter(lora, str(tmp_path / "plain"), rank=4, alpha=8.0)
    assert load_peft_norms(plain, config.num_hidden_layers) is None


def test_export_is_atomic_and_a_failure_keeps_the_previous_adapter(tmp_path, monkeypatch):
    import errno

    from qerl_jax.model_io import peft_adapter

    lora = {"layers": {"q_proj": {"a": np.ones((2, 4, 8), np.float32), "b": np.zeros((2, 6, 4), np.float32)}}}
    out = tmp_path / "adapter"
    export_peft_adapter(lora, str(out), rank=4, alpha=8.0)
    before = {n: (out / n).read_bytes() for n in os.listdir(out)}

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(peft_adapter, "save_file", disk_full)
    with pytest.raises(peft_adapter.AdapterWriteError, match=r"adapter to .*adapter: \[Errno 28\] No space left"):
        export_peft_adapter({"layers": {"v_proj": lora["layers"]["q_proj"]}}, str(out), rank=4, alpha=8.0)
    assert {n: (out / n).read_bytes() for n in os.listdir(out)} == before  # the earlier export, untouched
    assert sorted(os.listdir(tmp_path)) == ["adapter"]  # no half-written folder left beside it
    fresh = tmp_path / "fresh"
    with pytest.raises(peft_adapter.AdapterWriteError):
        export_peft_adapter(lora, str(fresh), rank=4, alpha=8.0)
    assert not fresh.exists()  # not a config without its weights
    monkeypatch.undo()
    export_peft_adapter({"layers": {"v_proj": lora["layers"]["q_proj"]}}, str(out), rank=4, alpha=8.0)
    assert json.loads((out / "adapter_config.json").read_text())["target_modules"] == ["v_proj"]
