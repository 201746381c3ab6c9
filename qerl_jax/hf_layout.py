"""The Hugging Face checkpoint layout that both readers (`loader`, `gguf`) produce and check."""

from __future__ import annotations

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
