"""Which sequence decodes in which row, and when: the rollout's host-side scheduler (numpy only).

The N = B * G sequences of a `generate` call form a queue (sequence b * G + g = sample g of
prompt b). A bucket of R rows holds at most `max_batch` of them at once (continuous batching):
every free row takes the next queued sequence (its prompt prefilled
  into the row: `programs.admit`); a row retires as soon as its sequence stops (EOS / stop id /
  its token limit) and the decode loop hands control back once `refill` rows are free, so they
  are refilled. When the queue is empty, the decode loop hands back once the live rows fit a
  smaller bucket of `smaller` (e.g. 64, then 16), and they are compacted into it
(`programs.compact`): the tail of long completions runs at a small batch.

A caller that decides while the rollout runs which sequences it needs (DAPO's dynamic
sampling, `rl.dynamic_sampling`) bounds the queue (`set_bounds`): sequences at or past `limit`
wait (they may be admitted later), those at or past `end` are dropped, queued or decoding.

Shape buckets keep the compiled programs few: prompts are padded to `prompt_bucket`, the new
tokens to `new_tokens_bucket`, rows to `rows_bucket`, and the smaller buckets are a short fixed
list (`DEFAULT_SMALLER_ROWS`), so a call compiles one admission program and one decode program
per row bucket it reaches.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

# The row buckets the schedule compacts the tail into (those below the call's rows):
# at most 64 rows the Hopper wgmma W4A16 kernel decodes (weights.WGMMA_MAX_ROWS), and a step at
# 16 rows costs little more than one at 1 (the weights' bytes dominate).
DEFAULT_SMALLER_ROWS = (64, 16)
# A continuous decode loop hands back for a refill once this fraction of its rows is free.
REFILL_FRACTION = 8


def prompt_bucket(n: int) -> int:
    """Padded prompt length: a power of two >= 16 up to 2048, then a multiple of 1024."""
    if n <= 2048:
        return max(16, 1 << max(0, math.ceil(math.log2(max(n, 1)))))
    return -(-n // 1024) * 1024


def new_tokens_bucket(n: int) -> int:
    """Response buffer length: a multiple of 64."""
    return -(-n // 64) * 64


# The fewest response tokens a resumption's forward spans (`resume_span`).
MIN_RESUME_SPAN = 64


def resume_span(n: int, new_slots: int) -> int:
    """The response tokens a resumption's forward spans to re-prefill n of them: a power of two >= n
    (at least MIN_RESUME_SPAN), at most the response buffer's new_slots. Few buckets (few programs),
    and a sequence paused early is not re-prefilled over the whole buffer."""
    return min(new_slots, max(MIN_RESUME_SPAN, 1 << max(0, math.ceil(math.log2(max(n, 1))))))


def resume_spans(new_slots: int) -> tuple[int, ...]:
    """Every span `resume_span` gives for a response buffer of new_slots slots, shortest first."""
    return tuple(sorted({resume_span(1 << i, new_slots) for i in range(max(1, new_slots).bit_length() + 1)}))


def rows_bucket(n: int) -> int:
    """Padded batch size: a power of two up to 8, then a multiple of 8."""
    return 1 << math.ceil(math.log2(n)) if n <= 8 else -(-n // 8) * 8


def rows_candidates(n: int) -> list[int]:
    """The row buckets up to rows_bucket(n), largest first."""
    top = rows_bucket(n)
    return [r for r in range(top, 8, -8)] + [r for r in (8, 4, 2, 1) if r <= top]


def admit_rows(rows: int) -> int:
    """Rows one admission (prefill) program fills: a quarter of the bucket, 8 to 64."""
    return min(rows, max(8, min(64, rows // 4)))


def admit_prompts(rows: int, group_size: int, share_prefill: bool) -> int:
    """Prompts one admission prefills: as many as `rows` consecutive sequences can span."""
    if not share_prefill:
        return rows
    return min(rows, (rows + group_size - 2) // group_size + 1)


@dataclasses.dataclass(frozen=True)
class Layout:
    """The row buckets of a rollout: `rows` (the first bucket) holding `max_batch` sequences at
    once, `smaller` (compaction buckets), and
    one admission's `admit_rows` rows from `admit_prompts` prefilled prompts."""

    rows: int
    max_batch: int
    smaller: tuple[int, ...]
    admit_rows: int
    admit_prompts: int


def layout(
    max_batch: int,
    *,
    group_size: int = 1,
    smaller_rows: Sequence[int] = DEFAULT_SMALLER_ROWS,
    share_prefill: bool = True,
    shards: int = 1,
) -> Layout:
    """The `Layout` of a rollout decoding at most `max_batch` sequences at once; every bucket a
    multiple of `shards` (data-parallel rows)."""
    round_up = lambda n: -(-n // shards) * shards  # noqa: E731
    rows = round_up(rows_bucket(max_batch))
    smaller = tuple(sorted({b for b in smaller_rows if b < rows and b % shards == 0}, reverse=True))
    k = round_up(admit_rows(rows))
    return Layout(rows, max_batch, smaller, k, round_up(admit_prompts(k, group_size, share_prefill)))


class Scheduler:
    """The queue and the rows' occupancy. Rows hold a sequence id or -1 (free)."""

    def __init__(
        self,
        num_seqs: int,
        *,
        rows: int,
        max_batch: int,
        smaller: tuple[int, ...] = (),
        refill: int | None = None,
        skip: np.ndarray | None = None,
    ):
        if not 1 <= max_batch <= rows:
            raise ValueError(f"max_batch must be in [1, rows={rows}]; got {max_batch}")
        self.num_seqs = num_seqs
        self.rows = rows
        self.max_batch = max_batch
        self.smaller = tuple(sorted((b for b in smaller if b < rows), reverse=True))
        self.refill = refill or max(1, max_batch // REFILL_FRACTION)
        self.row_seq = np.full((rows,), -1, np.int64)
        self.next_seq = 0
        self.limit = num_seqs  # sequences [next_seq, min(limit, end)) may be admitted now
        self.end = num_seqs  # sequences at or past it are not needed
        # bool [N]: sequences never admitted (a resumed call's finished ones, `sampler.Partial`)
        self.skip = np.zeros((num_seqs,), bool) if skip is None else np.asarray(skip, bool)

    def _admissible(self) -> np.ndarray:
        """The sequences that may be admitted now, in queue order."""
        bound = min(self.limit, self.end)
        return self.next_seq + np.flatnonzero(~self.skip[self.next_seq : max(bound, self.next_seq)])

    @property
    def queued(self) -> int:
        return len(self._admissible())

    @property
    def idle(self) -> bool:
        """Nothing decoding and nothing admissible."""
        return self.queued == 0 and bool(np.all(self.row_seq < 0))

    def set_bounds(self, limit: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """Admits sequences below `limit` only and drops those at or past `end` (both only ever
        lower `end`); returns the (rows, sequences) of dropped sequences that were decoding (the
        rows now free)."""
        self.limit = limit
        self.end = min(self.end, end)
        rows = np.flatnonzero(self.row_seq >= self.end)
        seqs = self.row_seq[rows].copy()
        self.row_seq[rows] = -1
        return rows, seqs

    def admissions(self) -> tuple[np.ndarray, np.ndarray]:
        """The (sequences, rows) to admit now, in queue order into ascending free rows."""
        free = np.flatnonzero(self.row_seq[: self.max_batch] < 0)
        seqs = self._admissible()[: len(free)]
        rows = free[: len(seqs)]
        if len(seqs):
            self.next_seq = int(seqs[-1]) + 1
        self.row_seq[rows] = seqs
        return seqs, rows

    def exit_live(self) -> int:
        """The decode loop runs while more than this many rows are live."""
        if self.queued:
            return self.max_batch - min(self.refill, self.queued)
        return self.smaller[0] if self.smaller else 0

    def retire(self, live_R: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Frees the rows whose sequences stopped; returns their (rows, sequences)."""
        rows = np.flatnonzero((self.row_seq >= 0) & ~np.asarray(live_R, bool))
        seqs = self.row_seq[rows].copy()
        self.row_seq[rows] = -1
        return rows, seqs

    def compaction(self) -> np.ndarray | None:
        """With the queue empty and the live rows within a smaller bucket: the rows to keep (the
        live ones in order, then copies of row 0 as padding) of the smallest bucket that holds
        them, which becomes the current one; else None. Call after `retire`."""
        live = np.flatnonzero(self.row_seq >= 0)
        if self.queued or not self.smaller or len(live) == 0 or len(live) > self.smaller[0]:
            return None
        bucket = min(b for b in self.smaller if b >= len(live))
        keep = np.zeros((bucket,), np.int64)
        keep[: len(live)] = live
        self.row_seq = np.concatenate([self.row_seq[live], np.full((bucket - len(live),), -1, np.int64)])
        self.rows = self.max_batch = bucket
        self.smaller = tuple(b for b in self.smaller if b < bucket)
        return keep
