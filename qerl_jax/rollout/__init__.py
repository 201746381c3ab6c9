"""The rollout engine: KV-cache generation on the (quantized, LoRA-adapted) policy.

from qerl_jax.rollout import SamplingConfig, generate, to_train_batch
batch = generate(config, params, prompt_ids, prompt_mask, key,
                 SamplingConfig(temperature=1.0, max_new_tokens=512), group_size=8, lora_scale=2.0)
train = to_train_batch(batch)  # {input_ids, attention_mask, response_mask, old_logp}

Modules, one concern each: `sampler` (`generate`: validation, planning, the driver loop),
`scheduler` (queue, retire, refill, compaction; buckets), `programs` (the jitted admission,
decode and compaction programs), `weights` (the decode weights: per-layer, bf16 and wgmma
copies, fused q/k/v and gate/up, stacked LoRA), `budget` (the memory estimate), `sampling`
(logit processors and token draws), `batch` (`RolloutBatch`, `to_train_batch`).
"""

from qerl_jax.rollout.batch import RolloutBatch, to_train_batch
from qerl_jax.rollout.budget import (
    MEMORY_MARGIN,
    RolloutMemory,
    cache_bytes,
    device_free_bytes,
    estimate_rollout_bytes,
    rollout_memory,
)
from qerl_jax.rollout.sampler import (
    RolloutOptions,
    RolloutPart,
    RolloutPlan,
    decode_attention_backend,
    generate,
    plan_rollout,
)
from qerl_jax.rollout.sampling import SamplingConfig, processed_logits, sample, top_k_filter, top_p_filter
from qerl_jax.rollout.scheduler import DEFAULT_SMALLER_ROWS, new_tokens_bucket, prompt_bucket, rows_bucket
from qerl_jax.rollout.weights import (
    decode_weight_names,
    dense_copy_bytes,
    dense_weight_names,
    fused_lora_bytes,
    layer_copy_bytes,
    small_packed_names,
    use_dense_weights,
    wgmma_copy_bytes,
    wgmma_weight_names,
)

__all__ = [
    "DEFAULT_SMALLER_ROWS",
    "MEMORY_MARGIN",
    "RolloutBatch",
    "RolloutMemory",
    "RolloutOptions",
    "RolloutPart",
    "RolloutPlan",
    "SamplingConfig",
    "cache_bytes",
    "decode_attention_backend",
    "decode_weight_names",
    "dense_copy_bytes",
    "dense_weight_names",
    "device_free_bytes",
    "estimate_rollout_bytes",
    "fused_lora_bytes",
    "generate",
    "layer_copy_bytes",
    "new_tokens_bucket",
    "plan_rollout",
    "processed_logits",
    "prompt_bucket",
    "rollout_memory",
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
