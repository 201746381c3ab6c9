"""The rollout engine: KV-cache generation on the (quantized, LoRA-adapted) policy.

from qerl_jax.rollout import SamplingConfig, generate, to_train_batch
batch = generate(config, params, prompt_ids, prompt_mask, key,
                 SamplingConfig(temperature=1.0, max_new_tokens=512), group_size=8, lora_scale=2.0)
train = to_train_batch(batch)  # {input_ids, attention_mask, response_mask, old_logp}
"""

from qerl_jax.rollout.sampler import (
    RolloutBatch,
    cache_bytes,
    decode_weight_names,
    dense_copy_bytes,
    dense_weight_names,
    device_free_bytes,
    estimate_rollout_bytes,
    generate,
    new_tokens_bucket,
    prompt_bucket,
    rows_bucket,
    small_packed_names,
    to_train_batch,
    use_dense_weights,
    wgmma_copy_bytes,
    wgmma_weight_names,
)
from qerl_jax.rollout.sampling import SamplingConfig, processed_logits, sample, top_k_filter, top_p_filter

__all__ = [
    "RolloutBatch",
    "SamplingConfig",
    "cache_bytes",
    "decode_weight_names",
    "dense_copy_bytes",
    "dense_weight_names",
    "device_free_bytes",
    "estimate_rollout_bytes",
    "generate",
    "new_tokens_bucket",
    "processed_logits",
    "prompt_bucket",
    "rows_bucket",
    "sample",
    "small_packed_names",
    "to_train_batch",
    "top_k_filter",
    "top_p_filter",
    "use_dense_weights",
    "wgmma_copy_bytes",
    "wgmma_weight_names",
]
