"""rl/dynamic_sampling.py: which groups DAPO keeps, and the tracker that decides it while the
rollout runs (a fake scorer: futures resolved by the test)."""

import concurrent.futures
import time

import numpy as np

from qerl_jax.rl import dynamic_sampling as ds

G = 2


def test_varied_needed_and_kept_groups():
    nan = np.nan
    shaped = np.array([1, 1, 0, 1, nan, nan, 0, nan, 1, 0], np.float32)  # groups: equal, varied, ?, ?, varied
    assert ds.varied_groups(shaped, G).tolist() == [False, True, False, False, True]
    assert ds.needed_groups(shaped, G, 1) == 2  # the first varied group is certain to be kept
    assert ds.needed_groups(shaped, G, 2) == 5
    assert ds.needed_groups(shaped, G, 3) == 5  # not enough: every group
    full = np.array([1, 1, 0, 1, 2, 2, 0, 3, 1, 0], np.float32)
    assert ds.kept_groups(full, G, 2).tolist() == [1, 3]
    assert ds.kept_groups(full, G, 2, dynamic=False).tolist() == [0, 1]


class _FakeScorer:
    """Futures the test resolves: reward = the value table's entry of each sequence."""

    def __init__(self, values):
        self.values = np.asarray(values, np.float32)
        self.futures = []

    def __call__(self, seqs, tokens, lengths):
        f = concurrent.futures.Future()
        self.futures.append((f, seqs))
        return f

    def resolve(self, count=None):
        for f, seqs in self.futures[:count]:
            if not f.done():
                f.set_result((self.values[seqs], self.values[seqs][None]))


def _finish(tracker, seqs):
    seqs = np.asarray(seqs)
    tracker.finished(seqs, np.zeros((len(seqs), 1), np.int32), np.ones(len(seqs), np.int32))


def test_tracker_paces_admissions_by_the_keep_rate():
    values = np.zeros(20)  # 10 groups, all with equal rewards so far
    scorer = _FakeScorer(values)
    tracker = ds.GroupTracker(10, G, want=2, submit=scorer, keep_rate=0.5)
    assert ds.groups_to_admit(2, 0.5) == 5  # 2 wanted / 0.5 -> 4 groups, x1.2 margin
    assert ds.groups_to_plan(32, 0.78) == 64 and ds.groups_to_plan(32, 1.0) == 48  # multiples of 16
    assert ds.groups_to_plan(32, 0.59) == ds.groups_to_plan(32, 0.05) == 64  # at most 2 x want: 65+ admit later
    assert [ds.round_to_plan(n, 32) for n in (1, 16, 17, 59, 64, 65)] == [16, 16, 32, 64, 64, 80]
    assert ds.round_to_plan(3, 1) == 3  # want 1: every count
    assert tracker.bounds(wait=False) == (5 * G, 10 * G)
    _finish(tracker, range(8))
    scorer.resolve()
    limit, end = tracker.bounds(wait=False)
    assert end == 10 * G and limit > 4 * G  # 4 equal groups: more are admitted, up to the end
    tracker_all = ds.GroupTracker(10, G, want=2, submit=_FakeScorer(values), dynamic=False)
    assert tracker_all.bounds(wait=False) == (2 * G, 2 * G)  # no dynamic sampling: the first 2 groups


def test_tracker_drops_groups_after_the_wanted_varied_ones():
    values = np.array([0, 1, 0, 0, 1, 0, 0, 0, 1, 1], np.float32)  # groups: varied, equal, varied, equal, equal
    scorer = _FakeScorer(values)
    tracker = ds.GroupTracker(5, G, want=2, submit=scorer, keep_rate=1.0)
    _finish(tracker, [0, 1, 4, 5])  # groups 0 and 2 done; group 1 still decoding
    limit, end = tracker.bounds(wait=False)
    assert end == 5 * G  # scores not in yet
    scorer.resolve()
    limit, end = tracker.bounds(wait=False)
    assert end == 3 * G and limit <= end  # group 1 may still vary: groups 3, 4 are not needed
    _finish(tracker, [2, 3, 6])  # group 3's sequence 6 stopped before it was dropped: not scored
    assert [s.tolist() for _, s in scorer.futures[-1:]] == [[2, 3]]
    scorer.resolve()
    shaped, each = tracker.results()
    assert ds.kept_groups(shaped[: tracker.end * G], G, 2).tolist() == [0, 2]
    assert np.isnan(shaped[6:]).all() and each.shape == (1, 10)


def test_waiting_returns_when_a_score_changes_the_bounds_or_none_can():
    values = np.array([0, 1, 0, 1], np.float32)
    scorer = _FakeScorer(values)
    tracker = ds.GroupTracker(2, G, want=1, submit=scorer)
    _finish(tracker, [0, 1])
    pool = concurrent.futures.ThreadPoolExecutor(1)
    waiting = pool.submit(tracker.bounds, True)
    time.sleep(0.2)
    assert not waiting.done()  # no score yet: nothing can change
    scorer.resolve()
    assert waiting.result(timeout=10) == (1 * G, 1 * G)  # group 0 varies: group 1 is dropped
    assert tracker.bounds(wait=True) == (1 * G, 1 * G)  # nothing pending: returns at once
    pool.shutdown()
