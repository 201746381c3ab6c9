"""A run's rewards, checked: once on a dataset row at start-up, then after every step.

A reward that raises on every completion scores them all 0: the run would go on, learning nothing,
with only a TensorBoard counter to tell. So:

- `sample_row_problems` calls each reward of `rl.reward` once, in this process, on a dataset row and
  a well-formed completion, before any model work: a wrong signature or a broken import is one line
  at start-up (`validate` reports it with the config's other problems).
- `RewardGuard.check_step` reads the pool's per-reward counts (`RewardPool.reward_stats`) after each
  step's scoring and stops the run (`RewardFailureError`, exit status 2) when one reward failed
  (raised, returned a non-finite value, timed out or killed its worker) on every completion of the
  step, or on more than `rl.reward_failure_fraction` of the completions of the last WINDOW_STEPS
  steps. It is called before the step trains, so the checkpoints on disk hold only steps trained
  on working rewards.
"""

from __future__ import annotations

import collections
import functools
import math
import signal
import threading
from typing import Any, Sequence

from qerl_jax import rewards
from qerl_jax.checkpoint import saved_steps
from qerl_jax.errors import UserFacingError

WINDOW_STEPS = 5  # the steps over which rl.reward_failure_fraction is judged


class RewardFailureError(UserFacingError):
    """A reward fails on (nearly) every completion: the run stops."""

    exit_code = 2


# ----------------------------------------------------------------------------- at start-up


def sample_completion(answer: str) -> str:
    """A well-formed completion of a row: its answer, boxed."""
    return f"The answer is \\boxed{{{answer}}}."


def sample_row_problems(spec: str, weights: Sequence[float], row: dict[str, Any], timeout_s: float) -> list[str]:
    """Problems of calling each reward of `spec` once on `row` (a dataset row: prompt, answer, other
    columns) with `sample_completion`, as the workers call it (`rewards.call_reward`): one
    "rl.reward = ...: ..." line per reward that raises, runs past `timeout_s` or returns a
    non-number."""
    fields = {"index": 0, **{k: v for k, v in row.items() if k != "answer"}}
    completion, answer = sample_completion(row["answer"]), row["answer"]
    out = []
    for name, _ in rewards.parse_reward_spec(spec, weights):
        call = functools.partial(rewards.call_reward, rewards.get_reward_fn(name), completion, answer, fields)
        where = f"rl.reward = {spec!r}: {name}(completion, answer, ...) on data.train's first row"
        try:
            value = _within(timeout_s, call)
        except _Timeout:
            out.append(f"{where} did not return within rl.reward_timeout_s = {timeout_s:g} s")
            continue
        except Exception as e:  # noqa: BLE001 (any failure of user code is the problem reported)
            out.append(f"{where} raised {_one_line(e)}")
            continue
        try:
            number = float(value)
        except (TypeError, ValueError):
            number = math.nan
        if not math.isfinite(number):
            out.append(f"{where} returned {value!r}; expected a finite number")
    return out


class _Timeout(Exception):
    pass


def _within(timeout_s: float, fn):
    """fn(), raising _Timeout after timeout_s (a SIGALRM timer, in the main thread only; elsewhere no limit)."""
    if threading.current_thread() is not threading.main_thread() or signal.getitimer(signal.ITIMER_REAL)[0]:
        return fn()  # a timer of someone else's is running: not ours to replace

    def expire(signum, frame):
        raise _Timeout()

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        return fn()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}"[:300] if text else type(error).__name__


# ----------------------------------------------------------------------------- during the run


class RewardGuard:
    """Stops a run whose reward fails; see the module docstring.

    pool: the run's `RewardPool`; max_failure_fraction: `rl.reward_failure_fraction`;
    checkpoint_dir: where the run's checkpoints are (named in the stopping line).
    """

    def __init__(self, pool: Any, max_failure_fraction: float, checkpoint_dir: str, window_steps: int = WINDOW_STEPS):
        self.pool = pool
        self.max_failure_fraction = max_failure_fraction
        self.checkpoint_dir = checkpoint_dir
        self._seen = self._counts()
        self._window: collections.deque[tuple[int, dict[str, tuple[int, int]]]] = collections.deque(maxlen=window_steps)

    def _counts(self) -> dict[str, tuple[int, int]]:
        return {name: (c["items"], c["failed"]) for name, c in self.pool.reward_stats.items()}

    def check_step(self, step: int) -> None:
        """Takes in the items the pool scored since the last call as step `step`'s; raises
        RewardFailureError if a reward failed on all of them, or on too many over the window."""
        now = self._counts()
        step_counts = {}
        for name, (items, failed) in now.items():
            items0, failed0 = self._seen.get(name, (0, 0))
            step_counts[name] = (items - items0, failed - failed0)
        self._seen = now
        self._window.append((step, step_counts))
        for name, (items, failed) in step_counts.items():
            if items and failed == items:
                self._stop(name, f"failed on every one of the {items} completions of step {step}")
        for name in step_counts:
            items = sum(counts.get(name, (0, 0))[0] for _, counts in self._window)
            failed = sum(counts.get(name, (0, 0))[1] for _, counts in self._window)
            if items and failed / items > self.max_failure_fraction:
                steps = f"step {step}" if len(self._window) == 1 else f"steps {self._window[0][0]}-{step}"
                self._stop(
                    name,
                    f"failed on {failed} of the {items} completions of {steps}, more than "
                    f"rl.reward_failure_fraction = {self.max_failure_fraction:g}",
                )

    def _stop(self, name: str, what: str) -> None:
        steps = saved_steps(self.checkpoint_dir)
        kept = (
            f"the last checkpoint (step {steps[-1]}) in {self.checkpoint_dir} is kept"
            if steps
            else "no checkpoint was written yet"
        )
        first = self.pool.first_errors.get(name, "?")
        raise RewardFailureError(f"reward {name!r} {what} (first error: {first}); stopped, {kept}")
