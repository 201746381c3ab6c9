"""Tests for qerl_jax.model_io.tiny: offline tokenizer and random HF Qwen2 checkpoint."""

import json
import os

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers

from qerl_jax.model_io import tiny


@pytest.fixture(scope="module")
def tok():
    return tiny.build_tiny_tokenizer()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny.build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt")


def _hf_load(path):
    model, info = transformers.Qwen2ForCausalLM.from_pretrained(path, output_loading_info=True, dtype=torch.float32)
    return model, info


# ---------------------------------------------------------------- tokenizer


def test_tokenizer_special_tokens_and_size(tok):
    assert len(tok) == 512
    assert tok.eos_token == tok.pad_token == "<|endoftext|>"
    assert tok.pad_token_id == tok.eos_token_id
    ids = tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    assert len(set(ids)) == 3 and all(0 <= i < 512 for i in ids)
    # Special tokens encode as one id each, never split into bytes.
    assert tok("<|im_start|>user<|im_end|>", add_special_tokens=False)["input_ids"][0] == ids[1]
    assert tok.bos_token is None


def test_tokenizer_round_trip_and_digits(tok):
    for text in ["Natalia sold 48/2 = 24 clips.\n\n  \\boxed{72}", "héllo wörld ✓ 3.14", "x^2 + y^2 = z^2\t$1,000"]:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text
    # Qwen2-style pre-tokenization: every digit is its own token.
    assert tok.tokenize("12345") == list("12345")


def test_tokenizer_is_deterministic(tok):
    again = tiny.build_tiny_tokenizer()
    assert again.backend_tokenizer.to_str() == tok.backend_tokenizer.to_str()
    other = tiny.build_tiny_tokenizer(texts=["only this tiny text, twice: only this tiny text"], vocab_size=300)
    assert len(other) == 300  # Filled up with reserved tokens.
    assert other.convert_tokens_to_ids("<|reserved_0|>") < 300
    assert other.backend_tokenizer.to_str() != tok.backend_tokenizer.to_str()


def test_chat_template(tok):
    messages = [{"role": "system", "content": "SYS"}, {"role": "user", "content": "Q?"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nSYS<|im_end|>\n<|im_start|>user\nQ?<|im_end|>\n<|im_start|>assistant\n")
    text = tok.apply_chat_template(messages[1:], tokenize=False, add_generation_prompt=False)
    assert text == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nQ?<|im_end|>\n")
    convo = messages + [{"role": "assistant", "content": "A."}]
    text = tok.apply_chat_template(convo, tokenize=False)
    assert text.endswith("<|im_start|>assistant\nA.<|im_end|>\n")


def test_tokenizer_validation():
    with pytest.raises(ValueError, match="vocab_size"):
        tiny.build_tiny_tokenizer(vocab_size=100)
    with pytest.raises(ValueError, match="texts is empty"):
        tiny.build_tiny_tokenizer(texts=[])


def test_saved_tokenizer_loads_with_autotokenizer(tmp_path, tok):
    tiny.build_tiny_tokenizer(tmp_path)
    loaded = transformers.AutoTokenizer.from_pretrained(tmp_path)
    text = "Weng earns $12 an hour. <|im_end|>"
    assert loaded(text)["input_ids"] == tok(text)["input_ids"]
    assert loaded.pad_token == "<|endoftext|>" and loaded.eos_token == "<|endoftext|>"
    msgs = [{"role": "user", "content": "2+2?"}]
    assert loaded.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == tok.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True
    )


def test_small_corpus_tokenizer_saves_with_reserved_tokens(tmp_path):
    small = tiny.build_tiny_tokenizer(tmp_path, texts=["a tiny corpus with 12 words"])
    loaded = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert len(small) == len(loaded) == 512
    text = "a tiny <|reserved_7|> 12"
    assert loaded(text)["input_ids"] == small(text)["input_ids"]
    assert small.convert_tokens_to_ids("<|reserved_7|>") in small(text)["input_ids"]


# ---------------------------------------------------------------- checkpoint


def test_checkpoint_config(ckpt, tok):
    cfg = json.load(open(os.path.join(ckpt, "config.json")))
    assert cfg["model_type"] == "qwen2" and cfg["architectures"] == ["Qwen2ForCausalLM"]
    assert cfg["vocab_size"] == len(tok) == 512
    assert (
        cfg["hidden_size"],
        cfg["num_hidden_layers"],
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["intermediate_size"],
    ) == (64, 2, 4, 2, 128)
    assert cfg["rope_theta"] == 1e6 and cfg["rms_norm_eps"] == 1e-6
    assert cfg["attention_bias"] is True and cfg["tie_word_embeddings"] is False
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    assert cfg["eos_token_id"] == cfg["pad_token_id"] == cfg["bos_token_id"] == eos
    gen = transformers.GenerationConfig.from_pretrained(ckpt)
    assert set(gen.eos_token_id) == {eos, tok.convert_tokens_to_ids("<|im_end|>")}
    hf_cfg = transformers.AutoConfig.from_pretrained(ckpt)
    assert hf_cfg.num_key_value_heads == 2 and hf_cfg.vocab_size == 512


def test_checkpoint_loads_in_transformers(ckpt):
    model, info = _hf_load(ckpt)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert not info["mismatched_keys"]
    # Every tensor in the file is the one the model holds.
    file = safetensors.numpy.load_file(os.path.join(ckpt, "model.safetensors"))
    assert all(v.dtype == ml_dtypes.bfloat16 for v in file.values())
    state = model.state_dict()
    assert set(file) == set(state)
    for name, arr in file.items():
        np.testing.assert_array_equal(state[name].numpy(), arr.astype(np.float32), err_msg=name)
    assert state["model.layers.1.self_attn.k_proj.weight"].shape == (32, 64)
    assert state["model.layers.0.mlp.down_proj.weight"].shape == (64, 128)
    np.testing.assert_array_equal(state["model.norm.weight"].numpy(), np.ones(64))
    std = np.std(file["model.layers.0.mlp.up_proj.weight"].astype(np.float32))
    assert 0.015 < std < 0.025
    assert np.abs(file["model.layers.0.self_attn.q_proj.bias"].astype(np.float32)).max() > 0
    with torch.no_grad():
        logits = model(torch.tensor([[1, 5, 9, 200]])).logits
    assert logits.shape == (1, 4, 512) and torch.isfinite(logits).all()


def test_checkpoint_tokenizer_and_chat_template(ckpt):
    loaded = transformers.AutoTokenizer.from_pretrained(ckpt)
    assert len(loaded) == 512
    out = loaded.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert out.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_checkpoint_tied_and_random_norms(tmp_path):
    path = tiny.build_tiny_checkpoint(tmp_path, tie_word_embeddings=True, random_norms=True, num_layers=1, seed=3)
    file = safetensors.numpy.load_file(os.path.join(path, "model.safetensors"))
    assert "lm_head.weight" not in file
    model, info = _hf_load(path)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    np.testing.assert_array_equal(
        model.lm_head.weight.detach().numpy(), file["model.embed_tokens.weight"].astype(np.float32)
    )
    norm = file["model.layers.0.input_layernorm.weight"].astype(np.float32)
    assert not np.allclose(norm, 1.0) and abs(norm.mean() - 1.0) < 0.1


def test_checkpoint_is_deterministic_and_skips_rebuild(tmp_path, ckpt):
    a = tiny.build_tiny_checkpoint(tmp_path / "a")
    fa = safetensors.numpy.load_file(os.path.join(a, "model.safetensors"))
    fc = safetensors.numpy.load_file(os.path.join(ckpt, "model.safetensors"))
    for k in fa:
        np.testing.assert_array_equal(fa[k], fc[k])
    mtime = os.stat(os.path.join(a, "model.safetensors")).st_mtime_ns
    tiny.build_tiny_checkpoint(tmp_path / "a")
    assert os.stat(os.path.join(a, "model.safetensors")).st_mtime_ns == mtime
    # Other arguments rebuild in place.
    tiny.build_tiny_checkpoint(tmp_path / "a", seed=1)
    f1 = safetensors.numpy.load_file(os.path.join(a, "model.safetensors"))
    assert not np.array_equal(f1["model.embed_tokens.weight"], fa["model.embed_tokens.weight"])
    # An incomplete directory is rebuilt.
    os.remove(os.path.join(a, "config.json"))
    tiny.build_tiny_checkpoint(tmp_path / "a", seed=1)
    assert os.path.isfile(os.path.join(a, "config.json"))


def test_checkpoint_validation(tmp_path):
    with pytest.raises(ValueError, match="num_heads"):
        tiny.build_tiny_checkpoint(tmp_path, hidden_size=60, num_heads=8)
    with pytest.raises(ValueError, match="num_kv_heads"):
        tiny.build_tiny_checkpoint(tmp_path, num_heads=4, num_kv_heads=3)


def test_hf_config_is_the_built_config_json_without_building(ckpt):
    with open(os.path.join(ckpt, "config.json")) as f:
        built = json.load(f)
    expected = tiny.hf_config()
    expected["torch_dtype"] = built["torch_dtype"]  # float32 where safetensors lacks numpy bf16
    assert built == expected
