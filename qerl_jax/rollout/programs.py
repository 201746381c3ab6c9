"""The rollout's jitted device programs, over a bucket of R rows with a KV cache of S slots:

- `new_rows`: an empty KV cache and row state.
- `admit`: prefill Bp (left-padded) prompts and copy each one's cache into the rows of its
  sequences (several rows per prompt: a group shares one prefill), sampling their first tokens.
- `resume`: re-admit sequences paused by an earlier call (partial rollouts): one forward over
  each one's prompt and the tokens it had, then the decode continues it where it stopped.
- `decode`: a `lax.while_loop` of decode steps, one token per live row per step, each row at
  its own position (`models.qwen2.DecodeSlots`: it writes one cache slot and attends to its
  own slots only), until few enough rows are live (`exit_live`: refill or compaction time).
- `compact`: the kept rows' caches and state gathered into a smaller bucket.

Cache layout: row r holds its prompt left-padded in slots [0, P) (the real tokens in
[start_r, P)) and its new tokens from slot P on, so its valid slots [start_r, P + t_r) are
contiguous, whatever sequence held the row before. The cache and the row state are donated to
each program and updated in place (one copy of the cache exists at a time; see `budget`).

Randomness: sequence q (its index in the call's B * G output, whatever its row, bucket or
admission) draws its step-t token with key fold_in(fold_in(key, q), t); tokens do not depend
on the scheduling.

The layers run one by one over per-layer weight and cache buffers (`weights.split_layers`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from qerl_jax.models.qwen2 import (
    DecoderLayer,
    DecodeSlots,
    ForwardOptions,
    ModelConfig,
    kv_head_shards,
    positions_from_mask,
    rms_norm,
)
from qerl_jax.rollout import weights
from qerl_jax.rollout.sampling import SamplingConfig, sample


@dataclasses.dataclass(frozen=True)
class Static:
    """Everything the compiled programs are specialised on (besides array shapes).

    Only the fields of `sampling` that change the drawing are kept (max_new_tokens, stop ids
    and pad id are runtime arguments), so they do not cause recompiles.
    """

    config: ModelConfig
    sampling: SamplingConfig
    options: ForwardOptions
    new_slots: int  # the new-token bucket M; cache slots S = P + M
    cache_dtype: str


@struct.dataclass
class Rows:
    """The decode state of a bucket of R rows ([R] each unless noted).

    seq: uint32 the row's sequence (its PRNG stream). start: int32 its first valid cache slot.
    t: int32 tokens sampled so far; the last one (`last`) is fed next, at slot P + t - 1.
    limit: int32 its max new tokens. live: still decoding. stopped: it sampled a stop id.
    tokens: int32 [R, M] its sampled ids (pad after the stop). logp: float32 [R, M] their log-probs.
    """

    seq: jax.Array
    start: jax.Array
    t: jax.Array
    last: jax.Array
    limit: jax.Array
    live: jax.Array
    stopped: jax.Array
    tokens: jax.Array
    logp: jax.Array


def _empty(static: Static, rows: int, prompt_slots: int, pad_id) -> tuple[Any, Rows]:
    cfg = static.config
    layer_shape = (rows, prompt_slots + static.new_slots, cfg.num_key_value_heads, cfg.head_dim)
    cache = [(jnp.zeros(layer_shape, static.cache_dtype),) * 2 for _ in range(cfg.num_hidden_layers)]
    zeros = jnp.zeros((rows,), jnp.int32)
    state = Rows(
        seq=jnp.zeros((rows,), jnp.uint32),
        start=zeros + prompt_slots,
        t=zeros + 1,
        last=zeros + pad_id,
        limit=zeros,
        live=jnp.zeros((rows,), bool),
        stopped=jnp.zeros((rows,), bool),
        tokens=jnp.full((rows, static.new_slots), pad_id, jnp.int32),
        logp=jnp.zeros((rows, static.new_slots), jnp.float32),
    )
    return cache, state


def new_rows(
    static: Static, rows: int, prompt_slots: int, pad_id: int, sharding: jax.sharding.Sharding | None = None
) -> tuple[Any, Rows]:
    """An empty cache (zeros) and row state for `rows` rows of prompt_slots + new_slots slots.

    sharding: of the rows' axis (e.g. NamedSharding(mesh, P("data")), or P() on a shard's
    devices); the cache as `cache_sharding` places it. None: default placement."""
    return _new_rows_jit(static, rows, prompt_slots, sharding)(jnp.int32(pad_id))


def cache_sharding(static: Static, sharding: jax.sharding.Sharding | None) -> jax.sharding.Sharding | None:
    """The KV cache's sharding beside rows placed with `sharding`. Rows replicated over a mesh
    whose "model" axis has M > 1 devices dividing the kv heads: the heads split over "model",
    where the tensor-parallel k/v projections leave them (so the programs return the cache as
    they took it, and each device holds 1/M of it); else `sharding`."""
    if not isinstance(sharding, NamedSharding) or not sharding.is_fully_replicated:
        return sharding
    if kv_head_shards(static.config.num_key_value_heads, dict(sharding.mesh.shape).get("model", 1)) > 1:
        return NamedSharding(sharding.mesh, P(None, None, "model"))
    return sharding


@functools.lru_cache(maxsize=64)
def _new_rows_jit(static: Static, rows: int, prompt_slots: int, sharding: jax.sharding.Sharding | None):
    fn = functools.partial(_empty, static, rows, prompt_slots)
    if sharding is None:
        return jax.jit(fn)
    shapes = jax.eval_shape(fn, jnp.int32(0))
    out_shardings = (
        jax.tree.map(lambda _: cache_sharding(static, sharding), shapes[0]),
        jax.tree.map(lambda _: sharding, shapes[1]),
    )
    return jax.jit(fn, out_shardings=out_shardings)


# ----------------------------------------------------------------------------- the model


def _hidden(static: Static, params, ids_BxT, positions_BxT, kv_valid_BxS, cache, cache_index):
    """Final normed hidden states [B, T, D] and the updated cache, layer by layer: params from
    `weights.split_layers` and cache a list of per-layer (k, v) [B, S, KVH, hd], each layer run by
    the model's `DecoderLayer`.
    """
    cfg = static.config
    h = jnp.take(params["top"]["embed"], ids_BxT, axis=0)
    new_cache = []
    for layer, cache_l in enumerate(cache):
        vars_l = weights.layer_vars(params, layer)
        if ids_BxT.shape[1] > 1:
            # A prefill dequantizes packed weights before its matmuls (M > 64): tied to the layer's
            # input, XLA cannot schedule every layer's bf16 weights first and keep them all alive
            # (7B NVFP4, one prompt: a 12 GiB temporary, one layer's 0.4 GiB with the barrier).
            h, vars_l = jax.lax.optimization_barrier((h, vars_l))
        h, cache_l = _layer_jit(cfg, static.options, vars_l, h, cache_l, positions_BxT, kv_valid_BxS, cache_index)
        new_cache.append(cache_l)
    return rms_norm(h, params["top"]["final_norm"], cfg.rms_norm_eps), new_cache


def _layer(config, options, vars_l, h, cache_l, positions_BxT, kv_valid_BxS, cache_index):
    return DecoderLayer(config, options).apply(vars_l, h, cache_l, positions_BxT, kv_valid_BxS, cache_index)


# A jit inside the programs: JAX traces and lowers the layer once and calls it L times (XLA
# inlines the calls), which keeps the compile time of the unrolled programs down, notably
# with Pallas kernels (one Triton lowering per kernel instead of one per layer).
_layer_jit = jax.jit(_layer, static_argnums=(0, 1))


def _lm_logits(static: Static, params: dict[str, Any], h_BxD: jax.Array) -> jax.Array:
    """float32 [B, V] logits of final normed hidden states (the model's own head, one position)."""
    top = params["top"]
    head = top["embed"] if static.config.tie_word_embeddings else top["lm_head"]
    return jnp.einsum("bd,vd->bv", h_BxD, head.astype(h_BxD.dtype), preferred_element_type=jnp.float32)


def _token_keys(key: jax.Array, seq_R: jax.Array, t_R: jax.Array) -> jax.Array:
    """Each row's key for its step t: fold_in(fold_in(key, seq), t)."""
    seq_keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, seq_R)
    return jax.vmap(jax.random.fold_in)(seq_keys, t_R)


# ----------------------------------------------------------------------------- programs


def _admit(
    static: Static, params, cache, rows: Rows, ids_BxP, mask_BxP, src_K, dest_K, seq_K, limit_K, key, stop_V, pad_id
):
    """Prefills B prompts and admits K sequences: sequence k (id seq_K[k], prompt src_K[k]) goes
    to row dest_K[k] (>= R: none). Its prompt's cache is copied into the row's slots [0, P), its
    first token is sampled (step 0) and its state reset (pad_id: int32 for its unsampled tokens).
    Returns (cache, rows)."""
    cfg = static.config
    b, p = ids_BxP.shape
    layer_shape = (b, p, cfg.num_key_value_heads, cfg.head_dim)
    prompt_cache = [(jnp.zeros(layer_shape, static.cache_dtype),) * 2 for _ in range(cfg.num_hidden_layers)]
    positions_BxP = positions_from_mask(mask_BxP)
    h_BxPxD, prompt_cache = _hidden(static, params, ids_BxP, positions_BxP, mask_BxP.astype(bool), prompt_cache, 0)
    logits_BxV = _lm_logits(static, params, h_BxPxD[:, -1])

    insert = lambda big, small: big.at[dest_K, :p].set(small[src_K], mode="drop")  # noqa: E731
    cache = jax.tree.map(insert, cache, prompt_cache)

    first_K, logp_K = sample(_token_keys(key, seq_K, jnp.zeros_like(limit_K)), logits_BxV[src_K], static.sampling)
    stop_K = stop_V[first_K]
    tokens_KxM = jnp.full((first_K.shape[0], static.new_slots), pad_id, jnp.int32).at[:, 0].set(first_K)
    logp_KxM = jnp.zeros((first_K.shape[0], static.new_slots), jnp.float32).at[:, 0].set(logp_K)
    put = lambda a, v: a.at[dest_K].set(v, mode="drop")  # noqa: E731
    rows = Rows(
        seq=put(rows.seq, seq_K),
        start=put(rows.start, p - jnp.sum(mask_BxP, axis=1, dtype=jnp.int32)[src_K]),
        t=put(rows.t, jnp.ones_like(limit_K)),
        last=put(rows.last, first_K),
        limit=put(rows.limit, limit_K),
        live=put(rows.live, ~stop_K & (limit_K > 1)),
        stopped=put(rows.stopped, stop_K),
        tokens=put(rows.tokens, tokens_KxM),
        logp=put(rows.logp, logp_KxM),
    )
    return cache, rows


def _resume(
    static: Static, params, cache, rows: Rows, ids_KxP, mask_KxP, fed_KxT, tokens_KxM, logp_KxM, t_K, dest_K, seq_K,
    limit_K,
):  # fmt: skip
    """Re-admits K paused sequences: sequence k (stream seq_K[k]) goes to row dest_K[k] (>= R: none)
    with its prompt and its first t_K[k] >= 1 tokens (tokens_KxM, their log-probs logp_KxM). One
    forward over the prompt and tokens [0, t - 1) writes their slots [0, P + t - 1) (re-prefill: the
    paused call's cache is not kept); the next decode step feeds token t - 1 and samples token t with
    the key an uninterrupted decode would use. fed_KxT: the first T columns of tokens_KxM, T >= every
    t - 1 (`scheduler.resume_span`): the forward spans P + T slots, not the whole response buffer, and
    writes slots [0, P + T) of each row (the slots past a row's tokens are written by the decode before
    it attends to them, as after an admission). Returns (cache, rows)."""
    cfg = static.config
    k, p = ids_KxP.shape
    span = fed_KxT.shape[1]
    ids_KxS = jnp.concatenate([ids_KxP, fed_KxT], axis=1)
    valid_KxS = jnp.concatenate([mask_KxP.astype(bool), jnp.arange(span)[None, :] < t_K[:, None] - 1], axis=1)
    layer_shape = (k, p + span, cfg.num_key_value_heads, cfg.head_dim)
    fresh = [(jnp.zeros(layer_shape, static.cache_dtype),) * 2 for _ in range(cfg.num_hidden_layers)]
    _, fresh = _hidden(static, params, ids_KxS, positions_from_mask(valid_KxS), valid_KxS, fresh, 0)
    cache = jax.tree.map(lambda big, small: big.at[dest_K, : p + span].set(small, mode="drop"), cache, fresh)
    put = lambda a, v: a.at[dest_K].set(v, mode="drop")  # noqa: E731
    rows = Rows(
        seq=put(rows.seq, seq_K),
        start=put(rows.start, p - jnp.sum(mask_KxP, axis=1, dtype=jnp.int32)),
        t=put(rows.t, t_K),
        last=put(rows.last, jnp.take_along_axis(tokens_KxM, (t_K - 1)[:, None], axis=1)[:, 0]),
        limit=put(rows.limit, limit_K),
        live=put(rows.live, t_K < limit_K),
        stopped=put(rows.stopped, jnp.zeros_like(t_K, bool)),
        tokens=put(rows.tokens, tokens_KxM),
        logp=put(rows.logp, logp_KxM),
    )
    return cache, rows


def _decode(static: Static, params, cache, rows: Rows, key, stop_V, exit_live, max_steps):
    """Decode steps while more than `exit_live` rows are live, at most `max_steps` of them.
    Returns (cache, rows, steps run).

    A live row feeds its last token at slot P + t - 1 (position P + t - 1 - start), attends to
    [start, P + t), samples its token t and retires on a stop id (stop_V: bool [V]) or at its
    limit; other rows attend to nothing and keep their state. The cache and rows are returned
    (and dropped by the caller) so that XLA aliases them with the donated inputs.
    """
    r, m = rows.tokens.shape
    slots = jax.tree.leaves(cache)[0].shape[1]
    p = slots - static.new_slots
    row_ids = jnp.arange(r)

    def cond(carry):
        step, _, rows = carry
        return (jnp.sum(rows.live, dtype=jnp.int32) > exit_live) & (step < max_steps)

    def body(carry):
        step, cache, rows = carry
        write_R = p + rows.t - 1
        decode_slots = DecodeSlots(write_B=write_R, start_B=rows.start, end_B=jnp.where(rows.live, write_R + 1, 0))
        h_Rx1xD, cache = _hidden(
            static, params, rows.last[:, None], (write_R - rows.start)[:, None], None, cache, decode_slots
        )
        logits_RxV = _lm_logits(static, params, h_Rx1xD[:, 0])
        new_R, logp_R = sample(_token_keys(key, rows.seq, rows.t), logits_RxV, static.sampling)
        live = rows.live
        column_R = jnp.where(live, rows.t, m)  # out of range: not written
        hit_R = stop_V[new_R] & live
        t_R = rows.t + live
        rows = rows.replace(
            t=t_R,
            last=jnp.where(live, new_R, rows.last),
            live=live & ~hit_R & (t_R < rows.limit),
            stopped=rows.stopped | hit_R,
            tokens=rows.tokens.at[row_ids, column_R].set(new_R, mode="drop"),
            logp=rows.logp.at[row_ids, column_R].set(logp_R, mode="drop"),
        )
        return step + 1, cache, rows

    steps, cache, rows = jax.lax.while_loop(cond, body, (jnp.int32(0), cache, rows))
    return cache, rows, steps


def _compact(static: Static, cache, rows: Rows, keep_N, valid_N):
    """The rows keep_N (int32 [N]) of the cache and state, as a bucket of N rows; rows where
    valid_N is False are padding (not live)."""
    cache = jax.tree.map(lambda c: jnp.take(c, keep_N, axis=0), cache)
    rows = jax.tree.map(lambda a: jnp.take(a, keep_N, axis=0), rows)
    return cache, rows.replace(live=rows.live & valid_N)


def _stop(rows: Rows, stop_R):
    """Rows where stop_R (bool [R]) is True no longer decode."""
    return rows.replace(live=rows.live & ~stop_R)


# XLA's dot merger fuses a projection's LoRA-A dot (small) into its base dot (large), which
# share an input, by concatenating [W; A] inside the decode loop: compiled for an H100 (jax
# 0.10.2), a copy of every bf16 weight per step (7B, 256 rows: 56 concatenations, an 8.7 GiB
# temporary). Off for the rollout's programs (the A's of a fused call are stacked once per call
# instead: `weights`).
COMPILER_OPTIONS = {"xla_gpu_dot_merger_threshold_mb": 0}

admit = jax.jit(_admit, static_argnums=0, donate_argnums=(2, 3), compiler_options=COMPILER_OPTIONS)
resume = jax.jit(_resume, static_argnums=0, donate_argnums=(2, 3), compiler_options=COMPILER_OPTIONS)
decode = jax.jit(_decode, static_argnums=0, donate_argnums=(2, 3), compiler_options=COMPILER_OPTIONS)
compact = jax.jit(_compact, static_argnums=0)
stop = jax.jit(_stop, donate_argnums=0)
