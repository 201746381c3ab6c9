"""Per-token log-probabilities and entropies of a sequence under the (LoRA) policy.

Alignment, defined here once:
  `token_logprobs` returns logp [B, T-1] with logp[:, t] = log p(input_ids[:, t+1] | ids[:, :t+1]),
  i.e. the "next-token grid". Rollout batches are *token-aligned* [B, T]: old_logp[:, t] and
  response_mask[:, t] refer to the token at position t. `to_next_token_grid(x_BxT)` = x[:, 1:]
  maps a token-aligned array onto the next-token grid (position 0 has no log-prob: it must
  never be a response token), and `to_token_aligned(logp_BxTm1)` maps back (0 at position 0).

The LM head and log-softmax run in float32, optionally over chunks of `chunk_size` positions
(`lax.scan` with a rematerialised body), so the [B, T, V] float32 logits never exist at once,
neither in the forward nor in the backward pass.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from qerl_jax.linear import matmul_nt
from qerl_jax.models.qwen2 import ModelConfig, forward


def to_next_token_grid(x_BxT: jax.Array) -> jax.Array:
    """Token-aligned [B, T] -> next-token grid [B, T-1] (drops position 0)."""
    return x_BxT[:, 1:]


def to_token_aligned(x_BxTm1: jax.Array, fill: float = 0.0) -> jax.Array:
    """Next-token grid [B, T-1] -> token-aligned [B, T] (position 0 gets `fill`)."""
    pad = jnp.full((x_BxTm1.shape[0], 1), fill, x_BxTm1.dtype)
    return jnp.concatenate([pad, x_BxTm1], axis=1)


def lm_head(config: ModelConfig, params: dict[str, Any]) -> jax.Array:
    """The output embedding [V, D]: base["lm_head"], or the tied base["embed"]."""
    return params["base"]["embed"] if config.tie_word_embeddings else params["base"]["lm_head"]


def _chunk_logprobs(h_BxCxD, targets_BxC, head_VxD, temperature):
    with jax.named_scope("lm_head_logprobs"):
        return _chunk_logprobs_body(h_BxCxD, targets_BxC, head_VxD, temperature)


def _chunk_logprobs_body(h_BxCxD, targets_BxC, head_VxD, temperature):
    b, c, d = h_BxCxD.shape
    logits = matmul_nt(h_BxCxD.reshape(b * c, d), head_VxD).reshape(b, c, -1)  # float32, bf16 products
    if temperature != 1.0:
        logits = logits / temperature
    logz = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets_BxC[..., None], axis=-1)[..., 0]
    logits_sg, logz_sg = jax.lax.stop_gradient(logits), jax.lax.stop_gradient(logz)
    entropy = logz_sg - jnp.sum(jax.nn.softmax(logits_sg, axis=-1) * logits_sg, axis=-1)  # metric only: no gradient
    return target_logit - logz, entropy


def head_logprobs(
    h_BxSxD: jax.Array,
    targets_BxS: jax.Array,
    head_VxD: jax.Array,
    *,
    chunk_size: int | None = None,
    temperature: float = 1.0,
) -> tuple[jax.Array, jax.Array]:
    """log softmax(h @ head.T / temperature) gathered at targets, and the entropy; float32 [B, S] each."""
    b, s, d = h_BxSxD.shape
    targets_BxS = targets_BxS.astype(jnp.int32)
    if chunk_size is None or chunk_size >= s:
        return _chunk_logprobs(h_BxSxD, targets_BxS, head_VxD, temperature)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int or None; got {chunk_size}")
    n = -(-s // chunk_size)
    pad = n * chunk_size - s
    h = jnp.pad(h_BxSxD, ((0, 0), (0, pad), (0, 0)))
    t = jnp.pad(targets_BxS, ((0, 0), (0, pad)))
    h_NxBxCxD = h.reshape(b, n, chunk_size, d).transpose(1, 0, 2, 3)
    t_NxBxC = t.reshape(b, n, chunk_size).transpose(1, 0, 2)

    # Rematerialised body: the backward pass recomputes one chunk's logits at a time.
    body = jax.checkpoint(lambda hc, tc: _chunk_logprobs(hc, tc, head_VxD, temperature))

    def step(carry, xs):
        return carry, body(*xs)

    _, (logp, ent) = jax.lax.scan(step, None, (h_NxBxCxD, t_NxBxC))
    unchunk = lambda x: x.transpose(1, 0, 2).reshape(b, n * chunk_size)[:, :s]  # noqa: E731
    return unchunk(logp), unchunk(ent)


def token_logprobs(
    config: ModelConfig,
    params: dict[str, Any],
    input_ids: jax.Array,
    attention_mask: jax.Array,
    *,
    lora_scale: float = 1.0,
    backend: str = "xla",
    remat: bool | str = False,
    attention: str = "xla",
    chunk_size: int | None = None,
    temperature: float = 1.0,
    segment_ids: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Next-token log-probs and entropies of `input_ids` under `params` (LoRA included if present).

    Args:
      input_ids: int32 [B, T]; attention_mask: [B, T], 0 on (left) padding (None with segment_ids).
      segment_ids: int32 [B, T] of packed rows (`models.qwen2.forward`); logp[:, t] is then
        meaningful only where tokens t and t + 1 are of one segment.
      lora_scale, backend, remat, attention: passed to the model forward (`models.qwen2.forward`).
      chunk_size: positions per LM-head chunk (None: all at once).
      temperature: logits are divided by it (the sampler's temperature, so that rollout and
        training log-probs are of the same distribution).
    Returns:
      (logp, entropy), float32 [B, T-1] on the next-token grid (see module docstring). Values
      at padded positions are finite but meaningless; the entropy carries no gradient.
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0; got {temperature}")
    if input_ids.ndim != 2 or input_ids.shape[1] < 2:
        raise ValueError(f"input_ids must be [batch, seq] with seq >= 2; got shape {input_ids.shape}")
    h_BxTxD = forward(
        config,
        params,
        input_ids,
        attention_mask,
        lora_scale=lora_scale,
        backend=backend,
        remat=remat,
        attention=attention,
        compute_logits=False,
        segment_ids=segment_ids,
    )
    return head_logprobs(
        h_BxTxD[:, :-1],
        to_next_token_grid(input_ids),
        lm_head(config, params),
        chunk_size=chunk_size,
        temperature=float(temperature),
    )
