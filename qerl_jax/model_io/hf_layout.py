"""The Hugging Face checkpoint layout that both readers (`loader`, `gguf`) produce and check: tensor
names and shapes, config.json <-> ModelConfig, and the error both raise."""

from __future__ import annotations

import importlib.metadata
from typing import Any

from qerl_jax.models.qwen2 import ModelConfig, projection_shapes

SUPPORTED_ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded; the message names the path and field."""


def _hf_proj_prefix(proj: str) -> str:
    return "self_attn" if proj in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"


def hf_linear_name(layer: int, proj: str) -> str:
    """The HF module name of a projection, e.g. 'model.layers.3.self_attn.q_proj'."""
    return f"model.layers.{layer}.{_hf_proj_prefix(proj)}.{proj}"


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape for a dense checkpoint of this config."""
    d = config.hidden_size
    proj_shapes = projection_shapes(config)
    shapes = {"model.embed_tokens.weight": (config.vocab_size, d), "model.norm.weight": (d,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, d)
    for i in range(config.num_hidden_layers):
        shapes[f"model.layers.{i}.input_layernorm.weight"] = (d,)
        shapes[f"model.layers.{i}.post_attention_layernorm.weight"] = (d,)
        for proj, shape in proj_shapes.items():
            shapes[f"{hf_linear_name(i, proj)}.weight"] = shape
            if config.attention_bias and proj in ("q_proj", "k_proj", "v_proj"):
                shapes[f"{hf_linear_name(i, proj)}.bias"] = shape[:1]
    return shapes


def parse_config(raw: Any, cfg_path: str) -> ModelConfig:
    """A config.json's dict as a ModelConfig; problems name `cfg_path`."""
    if not isinstance(raw, dict):
        raise CheckpointError(f"{cfg_path}: expected a JSON object, got {type(raw).__name__}")
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(
            f"{cfg_path}: model_type {model_type!r} is not supported; expected one of {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    archs = raw.get("architectures") or [SUPPORTED_ARCHITECTURES[model_type]]
    if SUPPORTED_ARCHITECTURES[model_type] not in archs:
        raise CheckpointError(
            f"{cfg_path}: architectures {archs} is not supported; expected {SUPPORTED_ARCHITECTURES[model_type]!r}"
        )
    if raw.get("use_sliding_window"):
        raise CheckpointError(f"{cfg_path}: use_sliding_window=true is not supported (Qwen2.5 checkpoints have it off)")
    try:
        heads = raw["num_attention_heads"]
        eos = raw.get("eos_token_id")
        # transformers >= 5 writes rope_parameters (theta inside); older checkpoints rope_theta + rope_scaling.
        rope_params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        rope_theta = raw.get("rope_theta", rope_params.pop("rope_theta", 10000.0))
        rope_params.pop("rope_theta", None)
        if rope_params.get("rope_type", rope_params.get("type", "default")) == "default":
            rope_params = {}
        config = ModelConfig(
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads", heads),
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            attention_bias=raw.get("attention_bias", model_type == "qwen2"),
            max_position_embeddings=raw.get("max_position_embeddings", 32768),
            model_type=model_type,
            rope_scaling=tuple(sorted(rope_params.items())) if rope_params else None,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=tuple(eos if isinstance(eos, list) else [eos]) if eos is not None else (),
            pad_token_id=raw.get("pad_token_id"),
        )
    except KeyError as e:
        raise CheckpointError(f"{cfg_path}: required field {e.args[0]!r} is missing") from None
    if raw.get("mlp_bias"):
        raise CheckpointError(f"{cfg_path}: mlp_bias=true is not supported")
    if config.num_attention_heads % config.num_key_value_heads:
        raise CheckpointError(
            f"{cfg_path}: num_attention_heads={heads} is not a multiple of num_key_value_heads={config.num_key_value_heads}"
        )
    return config


def hf_config_dict(config: ModelConfig) -> dict[str, Any]:
    """A transformers config.json for `config` (LlamaForCausalLM / Qwen2ForCausalLM)."""
    out = {
        "architectures": [SUPPORTED_ARCHITECTURES[config.model_type]],
        "model_type": config.model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": dict(config.rope_scaling) if config.rope_scaling else None,
        "tie_word_embeddings": config.tie_word_embeddings,
        "attention_bias": config.attention_bias,
        "max_position_embeddings": config.max_position_embeddings,
        "hidden_act": "silu",
        "bos_token_id": config.bos_token_id,
        "eos_token_id": list(config.eos_token_id) or None,
        "pad_token_id": config.pad_token_id,
        "torch_dtype": "float32",
    }
    if config.model_type == "qwen2":
        out["use_sliding_window"] = False
    try:
        # transformers 5.x (5.17 at least) takes a local config.json without this field for an old
        # Mistral one and warns on every tokenizer load that its tokenization is wrong (it is not).
        out["transformers_version"] = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        pass
    return out
