"""Tests for qerl_jax.model_io.hf_layout: config.json <-> ModelConfig, checked through transformers'
own config classes, and the tensor names and shapes of a transformers model."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from qerl_jax.model_io.hf_layout import CheckpointError, expected_shapes, hf_config_dict, parse_config
from qerl_jax.models.qwen2 import ModelConfig

QWEN2 = ModelConfig(
    vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True,
    attention_bias=True, max_position_embeddings=256, model_type="qwen2", bos_token_id=None,
    eos_token_id=(3, 4), pad_token_id=2,
)  # fmt: skip
LLAMA = ModelConfig(
    vocab_size=80, hidden_size=48, intermediate_size=64, num_hidden_layers=3, num_attention_heads=6,
    num_key_value_heads=3, head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
    attention_bias=False, max_position_embeddings=512, model_type="llama",
    rope_scaling=(("factor", 2.0), ("rope_type", "linear")), bos_token_id=1, eos_token_id=(2,), pad_token_id=None,
)  # fmt: skip
CLASSES = {"qwen2": transformers.Qwen2Config, "llama": transformers.LlamaConfig}
MODELS = {"qwen2": transformers.Qwen2ForCausalLM, "llama": transformers.LlamaForCausalLM}


@pytest.mark.parametrize("config", [QWEN2, LLAMA], ids=["qwen2", "llama"])
def test_config_dict_round_trips_through_transformers(config):
    """Our config.json, read by transformers and written back by it, parses to the same config."""
    hf = CLASSES[config.model_type](**hf_config_dict(config))
    assert (hf.num_key_value_heads, hf.head_dim, hf.vocab_size) == (
        config.num_key_value_heads,
        config.head_dim,
        config.vocab_size,
    )
    assert parse_config(json.loads(hf.to_json_string()), "config.json") == config


@pytest.mark.parametrize("config", [QWEN2, LLAMA], ids=["qwen2", "llama"])
def test_expected_shapes_are_a_transformers_models_state_dict(config):
    torch.manual_seed(0)
    model = MODELS[config.model_type](CLASSES[config.model_type](**hf_config_dict(config)))
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items() if not k.endswith("inv_freq")}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight")  # the tied head is the embedding, not saved
    assert shapes == expected_shapes(config)


def test_parse_config_names_the_file_and_the_problem():
    raw = hf_config_dict(QWEN2)
    with pytest.raises(CheckpointError, match=r"^x/config.json: num_attention_heads=4 is not a multiple of"):
        parse_config({**raw, "num_key_value_heads": 3}, "x/config.json")
    with pytest.raises(CheckpointError, match=r"x/config.json: expected a JSON object, got list"):
        parse_config([raw], "x/config.json")


def test_config_names_the_transformers_version_that_reads_it():
    """transformers 5.17 takes a local config.json without `transformers_version` for an old Mistral
    one and warns on every tokenizer load (the GPU machine's runs printed it at each start)."""
    import importlib.metadata

    raw = hf_config_dict(QWEN2)
    assert raw["transformers_version"] == importlib.metadata.version("transformers")
