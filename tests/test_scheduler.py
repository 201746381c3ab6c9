"""rollout/scheduler.py: the queue, refill and compaction of the engine's rows, and its buckets."""

import numpy as np
import pytest

from qerl_jax.rollout import prompt_bucket, rows_bucket, scheduler


def test_scheduler_refills_free_rows_and_compacts_the_tail():
    s = scheduler.Scheduler(20, rows=8, max_batch=8, smaller=(4, 2), refill=2)
    seqs, rows = s.admissions()
    assert seqs.tolist() == list(range(8)) and rows.tolist() == list(range(8))
    assert s.exit_live() == 6  # hand back once 2 rows are free
    live = np.ones(8, bool)
    live[[1, 5]] = False
    assert [x.tolist() for x in s.retire(live)] == [[1, 5], [1, 5]]
    seqs, rows = s.admissions()
    assert seqs.tolist() == [8, 9] and rows.tolist() == [1, 5]
    s.next_seq = 20  # queue drained
    assert s.exit_live() == 4  # now: hand back when the live rows fit the next bucket
    live = np.zeros(8, bool)
    live[[2, 5, 7]] = True
    s.retire(live)
    keep = s.compaction()
    assert keep.tolist() == [2, 5, 7, 0] and s.rows == 4 and s.row_seq.tolist() == [2, 9, 7, -1]
    assert s.smaller == (2,) and s.exit_live() == 2
    assert s.compaction() is None  # 3 live rows do not fit 2


def test_layout_buckets():
    lay = scheduler.layout(256, group_size=8)
    assert (lay.rows, lay.smaller, lay.admit_rows, lay.admit_prompts) == (256, (64, 16), 64, 9)
    assert scheduler.layout(12, group_size=3).rows == 16
    assert scheduler.layout(20, shards=3).rows % 3 == 0
    assert scheduler.rows_candidates(20) == [24, 16, 8, 4, 2, 1]


def test_prompt_and_row_buckets():
    assert [prompt_bucket(n) for n in (1, 16, 17, 300, 2048, 2049)] == [16, 16, 32, 512, 2048, 3072]
    assert [rows_bucket(n) for n in (1, 3, 8, 9, 256)] == [1, 4, 8, 16, 256]


def test_bounds_hold_the_queue_and_drop_sequences():
    s = scheduler.Scheduler(10, rows=4, max_batch=4)
    assert s.set_bounds(2, 10)[0].size == 0
    seqs, rows = s.admissions()
    assert seqs.tolist() == [0, 1] and s.queued == 0 and not s.idle  # held at the limit
    s.set_bounds(6, 10)
    assert s.admissions()[0].tolist() == [2, 3]
    dropped, dropped_seqs = s.set_bounds(10, 3)  # sequences 3.. are no longer needed
    assert dropped.tolist() == [3] and dropped_seqs.tolist() == [3]
    assert s.row_seq.tolist() == [0, 1, 2, -1] and s.queued == 0
    s.set_bounds(10, 8)  # the end never grows back
    assert s.end == 3
    s.retire(np.zeros(4, bool))
    assert s.idle


def test_resume_span_is_a_power_of_two_holding_the_tokens_within_the_buffer():
    assert [scheduler.resume_span(n, 2048) for n in (0, 1, 63, 64, 65, 300, 1500, 2047)] == [
        64, 64, 64, 64, 128, 512, 2048, 2048,
    ]  # fmt: skip
    assert scheduler.resume_span(100, 128) == 128 and scheduler.resume_span(700, 640) == 640  # never past the buffer


@pytest.mark.parametrize("new_slots", [2048, 640, 64, 40])
def test_resume_spans_are_every_span_a_resumption_can_take(new_slots):
    spans = scheduler.resume_spans(new_slots)
    assert spans == tuple(sorted({scheduler.resume_span(n, new_slots) for n in range(new_slots + 1)}))
    assert {2048: (64, 128, 256, 512, 1024, 2048), 640: (64, 128, 256, 512, 640), 64: (64,), 40: (40,)}[new_slots] == spans
