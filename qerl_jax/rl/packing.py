"""Sequence packing for the train step: each sequence's real tokens, back to back in fixed-length rows.

A padded rollout batch (`rollout.batch.to_train_batch`: left-padded prompt, response, right
padding) trains on every slot of its [B, T] rows; most are padding when completions have a long
tail. `pack_batch` places each sequence's real tokens (prompt + response, no padding) into rows of
`row_len` slots (`pack_rows`: first-fit-decreasing, or a tighter fill where that needs fewer
rows), and returns the train step's packed batch:

  input_ids     int32   [R, L]  the packed rows (0 in the unused tail of a row)
  segment_ids   int32   [R, L]  1, 2, ... per sequence within its row; a row's unused tail is one
                                more segment of its own, so every token attends to at least itself
  token_index   int32   [B, L]  flat slot (row * L + column) of token t of sequence b, -1 past its end
  response_mask float32 [B, L]  per sequence, token-aligned and left-aligned (no left padding)
  old_logp      float32 [B, L]  likewise
  advantages    float32 [B]

R is a multiple of `rows_multiple` (the micro-batch; the extra rows are empty), L = row_len. The
per-sequence arrays have the fixed width L, so the step's programs compile once per (B, L).
RoPE positions restart at 0 in every segment (`models.qwen2.positions_from_segments`).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

PACKED_KEYS = ("input_ids", "segment_ids", "token_index", "response_mask", "old_logp", "advantages")


def first_fit_decreasing(lengths: Sequence[int], row_len: int) -> list[list[int]]:
    """Bins of sequence indices, each bin's lengths summing to <= row_len (first-fit, longest first).

    Zero-length sequences get no bin. Raises ValueError for a sequence longer than row_len.
    """
    lengths = np.asarray(lengths, np.int64)
    if lengths.size and lengths.max() > row_len:
        raise ValueError(f"a sequence of {int(lengths.max())} tokens does not fit rows of {row_len} slots")
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(np.flatnonzero(lengths > 0).tolist(), key=lambda j: (-lengths[j], j)):
        n = int(lengths[i])
        for r, space in enumerate(free):
            if n <= space:
                rows[r].append(i)
                free[r] -= n
                break
        else:
            rows.append([i])
            free.append(row_len - n)
    return rows


def slack_fit_decreasing(lengths: Sequence[int], row_len: int) -> list[list[int]]:
    """Bins filled one at a time: the longest remaining sequence, then the remaining subset whose
    lengths fill the rest of the row best (an exact subset sum; ties: the earlier sequences).

    Finds fewer rows than first-fit where first-fit strands a short sequence in a row of its own
    (e.g. lengths [112, 72, 50, 38, 31, 31, 29, ...] of 550 tokens in rows of 112: 5 rows, not 6).
    Same contract as `first_fit_decreasing`.
    """
    lengths = np.asarray(lengths, np.int64)
    if lengths.size and lengths.max() > row_len:
        raise ValueError(f"a sequence of {int(lengths.max())} tokens does not fit rows of {row_len} slots")
    remaining = sorted(np.flatnonzero(lengths > 0).tolist(), key=lambda j: (-lengths[j], j))
    rows: list[list[int]] = []
    while remaining:
        first, rest = remaining[0], remaining[1:]
        gap = row_len - int(lengths[first])
        full = (1 << (gap + 1)) - 1
        reach = [1]  # reach[k]: bit s set when some subset of rest[:k] sums to s (<= the gap)
        for i in rest:
            if reach[-1] >> gap:  # the row can be filled exactly already
                break
            reach.append((reach[-1] | (reach[-1] << int(lengths[i]))) & full)
        total, chosen = reach[-1].bit_length() - 1, []
        for k in range(len(reach) - 1, 0, -1):
            if not (reach[k - 1] >> total) & 1:  # the sum needs rest[k - 1]
                chosen.append(rest[k - 1])
                total -= int(lengths[rest[k - 1]])
        rows.append([first, *chosen[::-1]])
        taken = set(chosen)
        remaining = [i for i in rest if i not in taken]
    return rows


# Bound on rows x sequences x row_len for trying `slack_fit_decreasing` (about a second of host time).
SLACK_FIT_WORK = 2**30


def pack_rows(lengths: Sequence[int], row_len: int) -> list[list[int]]:
    """The packing `pack_batch` uses: `first_fit_decreasing`, or `slack_fit_decreasing` where that
    needs fewer rows (tried only when first-fit uses more than ceil(tokens / row_len) rows and the
    subset sums stay within SLACK_FIT_WORK)."""
    rows = first_fit_decreasing(lengths, row_len)
    work = len(rows) * len(lengths) * row_len
    if len(rows) > -(-int(np.sum(lengths)) // row_len) and work <= SLACK_FIT_WORK:
        tighter = slack_fit_decreasing(lengths, row_len)
        if len(tighter) < len(rows):
            return tighter
    return rows


def pack_batch(
    batch: dict[str, Any],
    row_len: int,
    *,
    rows_multiple: int = 1,
    rows: list[list[int]] | None = None,
) -> dict[str, np.ndarray]:
    """The packed train batch (module doc) of a padded one.

    batch: input_ids, attention_mask, response_mask, old_logp [B, T] (each row's real tokens
      contiguous, as rollouts produce) and advantages [B].
    row_len: L, slots per packed row (>= the longest sequence).
    rows_multiple: R is rounded up to a multiple of it with empty rows (the micro-batch size).
    rows: the sequences of each row (default `pack_rows` of the sequence lengths).
    """
    ids = np.asarray(batch["input_ids"])
    attn = np.asarray(batch["attention_mask"]).astype(bool)
    resp = np.asarray(batch["response_mask"], np.float32)
    old = np.asarray(batch["old_logp"], np.float32)
    b, t = ids.shape
    starts = np.argmax(attn, axis=1)
    lengths = attn.sum(axis=1)
    _check_contiguous(attn, resp)
    if rows is None:
        rows = pack_rows(lengths, row_len)
    n_rows = max(-(-len(rows) // rows_multiple) * rows_multiple, rows_multiple)
    out_ids = np.zeros((n_rows, row_len), np.int32)
    out_seg = np.zeros((n_rows, row_len), np.int32)
    token_index = np.full((b, row_len), -1, np.int32)
    seq_resp = np.zeros((b, row_len), np.float32)
    seq_old = np.zeros((b, row_len), np.float32)
    placed = np.zeros(b, bool)
    for r, members in enumerate(rows):
        col = 0
        for k, i in enumerate(members):
            n, s = int(lengths[i]), int(starts[i])
            if placed[i] or col + n > row_len:
                raise ValueError(f"row {r} of the packing places sequence {i} twice or past {row_len} slots")
            placed[i] = True
            out_ids[r, col : col + n] = ids[i, s : s + n]
            out_seg[r, col : col + n] = k + 1
            token_index[i, :n] = r * row_len + col + np.arange(n)
            seq_resp[i, :n] = resp[i, s : s + n]
            seq_old[i, :n] = old[i, s : s + n]
            col += n
        out_seg[r, col:] = len(members) + 1
    out_seg[len(rows) :] = 1
    missing = np.flatnonzero(~placed & (lengths > 0))
    if missing.size:
        raise ValueError(f"the packing leaves sequences {missing[:5].tolist()} out")
    return {
        "input_ids": out_ids,
        "segment_ids": out_seg,
        "token_index": token_index,
        "response_mask": seq_resp,
        "old_logp": seq_old,
        "advantages": np.asarray(batch["advantages"], np.float32),
    }


def _check_contiguous(attn: np.ndarray, resp: np.ndarray) -> None:
    """ValueError unless each row's real tokens are contiguous and its response tokens among them."""
    run_starts = attn & ~np.pad(attn, ((0, 0), (1, 0)))[:, :-1]
    holes = np.flatnonzero(run_starts.sum(axis=1) > 1)
    if holes.size:
        raise ValueError(f"batch['attention_mask'] rows {holes[:5].tolist()} have padding between real tokens")
    if (resp.astype(bool) & ~attn).any():
        raise ValueError("batch['response_mask'] marks tokens whose attention_mask is 0 (padding)")


def to_sequence_layout(x_BxT: Any, attention_mask_BxT: Any, width: int) -> np.ndarray:
    """A token-aligned padded array [B, T] -> the packed batch's per-sequence layout [B, width]
    (each row's real tokens moved to the front, zeros after); e.g. for a ref_logp."""
    x, attn = np.asarray(x_BxT), np.asarray(attention_mask_BxT).astype(bool)
    out = np.zeros((x.shape[0], width), x.dtype)
    for i in range(x.shape[0]):
        real = x[i][attn[i]]
        out[i, : real.size] = real
    return out


def token_counts(packed: dict[str, Any]) -> dict[str, int]:
    """Real tokens (of the sequences) and computed slots (R x L) of a packed batch."""
    ids = np.asarray(packed["input_ids"])
    return {"real": int((np.asarray(packed["token_index"]) >= 0).sum()), "computed": int(ids.size)}
