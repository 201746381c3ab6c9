"""The rollout's device memory: one estimate (`rollout_memory`), used by `generate` to size its
rows and refuse what would not fit before compiling, and by `qerl_jax.memory.plan_memory`.

Buffers of a `generate` call beyond the resident weights (see `RolloutMemory`):

  weight copies   the per-layer copies, bf16 and wgmma copies of `weights.split_layers`
  KV cache        [R rows, S slots] per layer, one copy: the programs take it donated and
                  update it in place (admission scatters prompts in, decode steps write a slot)
  row state       per-row outputs [R, M] and scalars
  + the largest of the programs' temporaries:
  admission       one prefill of Bp prompts (their caches, activations, scores, logits)
  decode          one step's work arrays (float32 logits and sampling, attention scores)
  compaction      the smaller bucket's cache and state, built while the old ones are alive

`tests/test_budget.py` checks these against XLA's memory analysis of the compiled
programs (CPU), and `benchmarks/devtools/rollout_memory.py` against the programs compiled for an
H100 (the 7B decode loop once held a transposed second cache there: a 30 GiB temporary the old
estimate did not count).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from qerl_jax.models.qwen2 import ModelConfig

# `generate` asks for this multiple of the estimate (allocator fragmentation, cuBLAS and
# autotuning workspaces; the estimate itself is checked against XLA's buffer assignment).
MEMORY_MARGIN = 1.1
SCORE_BYTES = 4 + 2  # float32 attention scores and their bf16 (activation-dtype) weights
# A decode step's attention, per (row, cache slot, head): float32 scores, their exponentials and
# the weights of the p.v matmul (XLA's CPU and GPU compilers each keep about three such arrays).
DECODE_ATTENTION_BYTES = 3 * 4
# Split-K partial sums XLA may keep for a decode step's matmuls: this many float32 copies of the
# widest projection's output (its GPU GEMM defaults split small-M matmuls along K).
SPLIT_K_PARTS = 4
LOGITS_WORK = 5  # float32 [rows, V] arrays of a sampling step: logits, log-softmax, filtered, noise, probs
ROW_SCALARS = 16  # int32/bool per-row state (sequence, start, tokens so far, last, limit, flags) and indices


def cache_bytes(config: ModelConfig, rows: int, slots: int, cache_dtype: Any = jnp.bfloat16) -> int:
    """Bytes of the K and V caches, each [L, rows, slots, KVH, head_dim]."""
    per_slot = config.num_key_value_heads * config.head_dim * jnp.dtype(cache_dtype).itemsize
    return 2 * config.num_hidden_layers * rows * slots * per_slot


@dataclasses.dataclass(frozen=True)
class RolloutMemory:
    """Bytes of a rollout of `rows` decode rows on top of the resident weights (see the module doc)."""

    kv_cache: int
    row_state: int
    admission: int
    decode: int
    compaction: int
    weight_copies: int

    @property
    def work(self) -> int:
        """The largest program's temporaries (the programs run one at a time)."""
        return max(self.admission, self.decode, self.compaction)

    @property
    def total(self) -> int:
        return self.kv_cache + self.row_state + self.work + self.weight_copies


def rollout_memory(
    config: ModelConfig,
    rows: int,
    prompt_len: int,
    new_tokens: int,
    *,
    admit_rows: int | None = None,
    admit_prompts: int | None = None,
    compact_rows: int = 0,
    cache_dtype: Any = jnp.bfloat16,
    act_dtype: Any = jnp.bfloat16,
    weight_copies: int = 0,
) -> RolloutMemory:
    """The memory of a rollout (bytes; L layers, D hidden, I MLP, H heads, V vocab, P prompt_len,
    M new_tokens, S = P + M cache slots, K admit_rows, Bp admit_prompts):

      kv_cache    `cache_bytes`(rows, S).
      row_state   rows * (M * 8 + ROW_SCALARS * 4): sampled ids and log-probs, per-row scalars.
      admission   `cache_bytes`(Bp, P) (the prompts' caches) + Bp*P*(3I + 4D)*act (one layer's
                  activations) + Bp*H*P*P*SCORE_BYTES (its attention scores) + Bp*V*4 (the last
                  position's logits) + LOGITS_WORK*K*V*4 (sampling the first tokens).
      decode      LOGITS_WORK*rows*V*4 + rows*S*(H*DECODE_ATTENTION_BYTES + 1) (one layer's
                  attention over the whole cache, and its slot mask) + rows*SPLIT_K_PARTS*N*4
                  (N the widest projection output: fused gate/up 2I, or q/k/v).
      compaction  `cache_bytes`(compact_rows, S) + its row state.
      weight_copies  as given (`weights.layer_copy_bytes` + bf16 + wgmma copies).

    admit_rows / admit_prompts default to rows (every row admitted in one prefill).
    """
    admit_rows = rows if admit_rows is None else admit_rows
    admit_prompts = admit_rows if admit_prompts is None else admit_prompts
    act = jnp.dtype(act_dtype).itemsize
    slots = prompt_len + new_tokens
    c = config

    def state(r: int) -> int:
        return r * (new_tokens * 8 + ROW_SCALARS * 4)

    admission = _admission_bytes(c, admit_rows, admit_prompts, prompt_len, cache_dtype, act)
    widest = max(2 * c.intermediate_size, (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim)
    decode = (
        LOGITS_WORK * rows * c.vocab_size * 4
        + rows * slots * (c.num_attention_heads * DECODE_ATTENTION_BYTES + 1)
        + rows * SPLIT_K_PARTS * widest * 4
        # one row: the XLA attention's einsums keep that row's cache in a dot-friendly layout,
        # copied in on the loop's entry (`qwen2.decode_attention_reference`)
        + (cache_bytes(c, 1, slots, cache_dtype) if rows == 1 else 0)
    )
    compaction = cache_bytes(c, compact_rows, slots, cache_dtype) + state(compact_rows) if compact_rows else 0
    return RolloutMemory(
        kv_cache=cache_bytes(c, rows, slots, cache_dtype),
        row_state=state(rows),
        admission=admission,
        decode=decode,
        compaction=compaction,
        weight_copies=weight_copies,
    )


def _admission_bytes(
    c: ModelConfig, admit_rows: int, admit_prompts: int, prompt_len: int, cache_dtype, act: int
) -> int:
    """`rollout_memory`'s admission term: the prompts' caches, one layer's activations and attention
    scores, the last position's logits, the first tokens' sampling."""
    tokens = admit_prompts * prompt_len
    return (
        cache_bytes(c, admit_prompts, prompt_len, cache_dtype)
        + tokens * (3 * c.intermediate_size + 4 * c.hidden_size) * act
        + admit_prompts * c.num_attention_heads * prompt_len * prompt_len * SCORE_BYTES
        + admit_prompts * c.vocab_size * 4
        + LOGITS_WORK * admit_rows * c.vocab_size * 4
    )


def estimate_rollout_bytes(
    config: ModelConfig,
    batch: int,
    prompt_len: int,
    max_new_tokens: int,
    cache_dtype: Any = jnp.bfloat16,
    *,
    num_prompts: int | None = None,
    admit_rows: int | None = None,
    compact_rows: int = 0,
    act_dtype: Any = jnp.bfloat16,
    layer_copy_bytes: int = 0,
) -> int:
    """`rollout_memory(...).total` for `batch` decode rows and `max_new_tokens` new-token slots:
    the device bytes a rollout allocates on top of the resident weights. num_prompts: prompts
    prefilled per admission (default all rows'); layer_copy_bytes: the weight copies."""
    return rollout_memory(
        config,
        batch,
        prompt_len,
        max_new_tokens,
        admit_rows=admit_rows,
        admit_prompts=num_prompts,
        compact_rows=compact_rows,
        cache_dtype=cache_dtype,
        act_dtype=act_dtype,
        weight_copies=layer_copy_bytes,
    ).total


def current_device() -> jax.Device:
    """The device new arrays go to in this thread: `jax.default_device`'s, else this process's first."""
    chosen = jax.config.jax_default_device
    return chosen if isinstance(chosen, jax.Device) else jax.local_devices()[0]


def device_free_bytes(device: jax.Device | None = None) -> int | None:
    """bytes_limit - bytes_in_use of the device (default: this thread's default device, as
    `jax.default_device` sets it for a data shard's rollout, else this process's first), or None
    where the backend does not report it."""
    device = device or current_device()
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 (some backends raise instead of returning None)
        return None
    if not stats or "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
