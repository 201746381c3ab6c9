"""The output of a rollout (`RolloutBatch`) and its conversion to the train step's input."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


@struct.dataclass
class RolloutBatch:
    """The output of `generate`; N = B * group_size rows, row b * G + g = sample g of prompt b.

    prompt_ids: int32 [N, P] left-padded prompts (P = the prompt bucket).
    prompt_mask: int32 [N, P] 1 on real prompt tokens.
    tokens: int32 [N, M] sampled response ids (M = max_new_tokens), pad_id after the stop.
    logprobs: float32 [N, M] log_softmax(logits / T) of each sampled token (before top-k/top-p
      truncation), 0 after the stop.
    response_mask: int32 [N, M] 1 up to and including the EOS/stop token.
    lengths: int32 [N] response lengths (EOS included).
    decoded: int32 [N] the tokens decoded for each sequence: its length, or for a sequence a
      monitor stopped as no longer needed, what it had decoded by then (its row stays empty).
    truncated: bool [N] True where no EOS/stop id came within the row's token limit
      (max_new_tokens or its own; always True with ignore_eos).
    prompt_index: int32 [N] the prompt (row of the input) each row was sampled from.
    steps: int32 [C] per decode segment (a run of the decode loop between admissions and
      compactions), 1 + the steps it ran (one segment: the sampling steps, <= M).
    segment_s: float32 [C, 2] per decode segment, the host's seconds before it (scheduling, the
      admissions' inputs and dispatch, harvesting the previous segment's rows) and the segment's
      own, from its dispatch to its live rows on the host (the queued admissions and compactions,
      then the decode loop). None where not timed.
    segment_rows: int32 [C] per decode segment, the rows of its bucket (each of its steps decodes
      that many, live or not). None where not recorded.
    group_size: G (static).
    """

    prompt_ids: jax.Array
    prompt_mask: jax.Array
    tokens: jax.Array
    logprobs: jax.Array
    response_mask: jax.Array
    lengths: jax.Array
    decoded: jax.Array
    truncated: jax.Array
    prompt_index: jax.Array
    steps: jax.Array
    segment_s: jax.Array | None = None
    segment_rows: jax.Array | None = None
    group_size: int = struct.field(pytree_node=False, default=1)


# Per decode segment: `steps` always, the others where recorded.
PER_SEGMENT = ("steps", "segment_s", "segment_rows")
PER_ROW = (
    "prompt_ids",
    "prompt_mask",
    "tokens",
    "logprobs",
    "response_mask",
    "lengths",
    "decoded",
    "truncated",
    "prompt_index",
)


def select_rows(batch: RolloutBatch, rows) -> RolloutBatch:
    """The given rows of a rollout (its per-row fields; the per-segment ones kept)."""
    return batch.replace(**{f: getattr(batch, f)[rows] for f in PER_ROW})


def concat(batches: list[RolloutBatch]) -> RolloutBatch:
    """The rows of several rollouts, in order, on the host (numpy fields: joining device arrays compiles
    programs for every new row count): prompts left-padded to the widest, the per-segment fields
    joined (the optional ones where every batch has them)."""
    width = max(b.prompt_ids.shape[1] for b in batches)

    def join(field: str) -> np.ndarray:
        parts = [np.asarray(getattr(b, field)) for b in batches]
        if field in ("prompt_ids", "prompt_mask"):  # prompts are left-padded
            parts = [np.pad(x, ((0, 0), (width - x.shape[1], 0))) for x in parts]
        return np.concatenate(parts)

    held = {f for f in PER_SEGMENT if all(getattr(b, f) is not None for b in batches)}
    joined = {f: join(f) if f in held else None for f in PER_SEGMENT}
    return batches[0].replace(**{f: join(f) for f in PER_ROW}, **joined)


def to_train_batch(batch: RolloutBatch, *, trim_to_multiple: int | None = None) -> dict[str, jax.Array]:
    """The train step's input: prompt (left-padded) then response (right-padded).

    Returns {"input_ids" int32 [N, T], "attention_mask" int32 [N, T], "response_mask" int32
    [N, T], "old_logp" float32 [N, T]} with T = P + M; old_logp[:, t] is the sampling log-prob
    of input_ids[:, t] (0 outside the response), i.e. it is predicted by the logits at t - 1.
    trim_to_multiple: drop response columns past the longest response, keeping a multiple of
    this many (fewer train-step shapes); None keeps all M columns.
    """
    tokens, logprobs, resp = batch.tokens, batch.logprobs, batch.response_mask
    if trim_to_multiple is not None:
        if trim_to_multiple < 1:
            raise ValueError(f"trim_to_multiple must be >= 1; got {trim_to_multiple}")
        longest = max(int(jnp.max(batch.lengths)), 1)
        width = min(tokens.shape[1], -(-longest // trim_to_multiple) * trim_to_multiple)
        tokens, logprobs, resp = tokens[:, :width], logprobs[:, :width], resp[:, :width]
    prompt_zeros = jnp.zeros_like(batch.prompt_mask)
    return {
        "input_ids": jnp.concatenate([batch.prompt_ids, tokens], axis=1),
        "attention_mask": jnp.concatenate([batch.prompt_mask, resp], axis=1),
        "response_mask": jnp.concatenate([prompt_zeros, resp], axis=1),
        "old_logp": jnp.concatenate([prompt_zeros.astype(jnp.float32), logprobs], axis=1),
    }
