"""DAPO's dynamic sampling, decided while the rollout runs (`GroupTracker`).

A step needs `want` groups (prompts x G completions) whose rewards vary: the others have zero
advantage. Several loader batches of prompts are sampled in one continuous-batching rollout, in
loader order; the kept groups are the first `want` with varied rewards in that order, exactly
those that rollouts of one batch after another ("refill rounds") would keep from the same
samples (`kept_groups`).

While the rollout runs, each sequence is scored as soon as it stops (`GroupTracker.finished`
submits it; the scores arrive asynchronously). A group's rewards are known to vary as soon as
two of its scores differ. Once `want` groups are known to vary, no group after the last of them
can be kept: those sequences are dropped, queued or decoding (`GroupTracker.bounds`' `end`).
Before that, prompts are admitted as the keep rate says they will be needed (`limit`): enough
groups that the undecided ones are expected to supply what is still missing, with a margin
(ADMIT_MARGIN).
"""

from __future__ import annotations

import concurrent.futures
import math
from collections.abc import Callable

import numpy as np

# Groups whose keep rate is assumed to be the prior's, in the estimate that paces admissions.
PRIOR_GROUPS = 4
# Admissions aim this much above the groups the keep rate says are needed: a group admitted late
# pays its own long tail after the others', while an extra one costs a few rows of the batch.
ADMIT_MARGIN = 1.2
# The lowest keep rate the pacing assumes (a step whose groups all have equal rewards would
# otherwise admit nothing more).
MIN_KEEP_RATE = 0.05
# The rollout's rows are planned for at most this many times the groups wanted; more are admitted
# as rows free up. Uncapped, a keep rate under 0.6 planned 80 groups for 32 wanted: a third row
# count (after 48 and 64 groups), whose programs compiled inside a step (~8 s for the 1.5B on an H200).
MOST_PLANNED = 2


def groups_to_admit(want: int, keep_rate: float) -> int:
    """Groups to admit at first for `want` with varied rewards at this keep rate (with a margin)."""
    return math.ceil(want / max(keep_rate, MIN_KEEP_RATE) * ADMIT_MARGIN - 1e-9)


def groups_to_add(want: int, varied_G: np.ndarray, decided_G: np.ndarray, keep_rate: float) -> int:
    """More groups to admit (0: none) while the groups admitted are not expected to give `want` with
    varied rewards. varied_G / decided_G: bool [admitted groups], those known to have varied rewards
    (a subset of) those whose outcome is known; the keep rate is estimated from the decided ones
    (with PRIOR_GROUPS at `keep_rate`), the undecided ones counted at it (over ADMIT_MARGIN)."""
    rate = (varied_G.sum() + PRIOR_GROUPS * keep_rate) / (decided_G.sum() + PRIOR_GROUPS)
    rate = max(float(rate), MIN_KEEP_RATE)
    missing = want - int(varied_G.sum()) - (~decided_G).sum() * rate / ADMIT_MARGIN
    return groups_to_admit(math.ceil(missing - 1e-6), rate) if missing > 1e-6 else 0


def groups_to_plan(want: int, keep_rate: float) -> int:
    """`groups_to_admit` rounded for planning the rollout's rows (`round_to_plan`), at most
    MOST_PLANNED * want."""
    return min(round_to_plan(groups_to_admit(want, keep_rate), want), MOST_PLANNED * want)


def round_to_plan(groups: int, want: int) -> int:
    """`groups` rounded up to a multiple of half of `want`: the rollout's rows, sized for them, take
    few distinct shapes as the keep rate moves (each new one compiles the call's programs, ~10 s for
    the 1.5B on an H200)."""
    quantum = max(1, want // 2)
    return -(-groups // quantum) * quantum


def varied_groups(shaped_N: np.ndarray, group_size: int) -> np.ndarray:
    """bool [groups]: groups two of whose known (not NaN) rewards differ."""
    r_GxN = shaped_N.reshape(-1, group_size)
    known = ~np.isnan(r_GxN)
    return np.where(known, r_GxN, -np.inf).max(axis=1) > np.where(known, r_GxN, np.inf).min(axis=1)


def needed_groups(shaped_N: np.ndarray, group_size: int, want: int) -> int:
    """How many leading groups can hold the kept ones: up to the `want`-th group known to vary
    (all groups if fewer are known to)."""
    varied = varied_groups(shaped_N, group_size)
    hits = np.flatnonzero(np.cumsum(varied) == want)
    return int(hits[0]) + 1 if want > 0 and hits.size else len(varied)


def kept_groups(shaped_N: np.ndarray, group_size: int, want: int, dynamic: bool = True) -> np.ndarray:
    """The indices of the groups a step trains on: the first `want` whose rewards vary
    (`dynamic`), else the first `want`. shaped_N: every reward of the needed groups known."""
    groups = len(shaped_N) // group_size
    if not dynamic:
        return np.arange(min(want, groups))
    return np.flatnonzero(varied_groups(shaped_N, group_size))[:want]


class GroupTracker:
    """A `rollout.sampler.RolloutMonitor` deciding DAPO's dynamic sampling over one rollout call.

    submit(seqs_K, tokens_KxM, lengths_K) -> a Future of (shaped rewards [K], each reward's
    scores [R, K]) scores stopped sequences (indices of the call's rows). Groups are the call's
    prompts in order; `want` of them are needed (with `dynamic` False: the first `want`, no
    pacing). keep_rate: the expected share of groups with varied rewards (e.g. the last step's),
    the prior of the pacing.
    """

    def __init__(
        self,
        num_groups: int,
        group_size: int,
        want: int,
        submit: Callable[[np.ndarray, np.ndarray, np.ndarray], concurrent.futures.Future],
        *,
        dynamic: bool = True,
        keep_rate: float = 1.0,
    ):
        self.group_size, self.want, self.dynamic = group_size, want, dynamic
        self.num_groups = num_groups if dynamic else min(want, num_groups)
        self.keep_rate = float(keep_rate)
        self._submit = submit
        self.shaped_N = np.full((num_groups * group_size,), np.nan, np.float32)
        self.each_RxN: np.ndarray | None = None
        self._pending: list[tuple[np.ndarray, concurrent.futures.Future]] = []
        self._limit = self.num_groups if not dynamic else min(self.num_groups, groups_to_admit(want, keep_rate))
        self._end = self.num_groups


    def finished(self, seqs_K: np.ndarray, tokens_KxM: np.ndarray, lengths_K: np.ndarray) -> None:
        seqs_K = np.asarray(seqs_K)
        needed = seqs_K < self._end * self.group_size
        if needed.any():
            future = self._submit(seqs_K[needed], tokens_KxM[needed], lengths_K[needed])
            self._pending.append((seqs_K[needed], future))

    def bounds(self, wait: bool) -> tuple[int, int]:
        """(limit, end) in sequences; with `wait`, until they change or no pending score can change them."""
        before = (self._limit, self._end)
        self._collect(block=False)
        self._update()
        while wait and (self._limit, self._end) == before and self._pending_needed():
            self._collect(block=True)
            self._update()
        return self._limit * self.group_size, self._end * self.group_size

    def results(self) -> tuple[np.ndarray, np.ndarray]:
        """(shaped_N, each_RxN) once every needed sequence's score is in (NaN / 0 for the others)."""
        while self._pending_needed():
            self._collect(block=True)
        if self.each_RxN is None:
            self.each_RxN = np.zeros((0, len(self.shaped_N)), np.float32)
        return self.shaped_N, self.each_RxN

    @property
    def end(self) -> int:
        """The groups still needed: those below it."""
        return self._end

    def _pending_needed(self) -> bool:
        bound = self._end * self.group_size
        return any(seqs.min() < bound for seqs, _ in self._pending)

    def _collect(self, block: bool) -> None:
        """Stores the scores that have arrived (with `block`, waits for at least one first)."""
        if block and self._pending:
            concurrent.futures.wait([f for _, f in self._pending], return_when=concurrent.futures.FIRST_COMPLETED)
        still = []
        for seqs, future in self._pending:
            if not future.done():
                still.append((seqs, future))
                continue
            shaped_K, each_RxK = future.result()
            if self.each_RxN is None:
                self.each_RxN = np.zeros((each_RxK.shape[0], len(self.shaped_N)), np.float32)
            self.shaped_N[seqs] = shaped_K
            self.each_RxN[:, seqs] = each_RxK
        self._pending = still

    def _update(self) -> None:
        if not self.dynamic:
            return
        self._end = min(self._end, needed_groups(self.shaped_N, self.group_size, self.want))
        r_GxN = self.shaped_N.reshape(-1, self.group_size)[: self._limit]
        varied = varied_groups(self.shaped_N, self.group_size)[: self._limit]
        decided = varied | ~np.isnan(r_GxN).any(axis=1)
        self._limit = min(self._end, self._limit + groups_to_add(self.want, varied, decided, self.keep_rate))
