"""A run's rewards, checked: once on a dataset row at start-up, then after every step.

A reward that raises on every completion scores them all 0: the run would go on, learning nothing,
with only a TensorBoard counter to tell. So:

- `sample_row_problems` scores a well-formed completion of a dataset row once with each reward of
  `rl.reward`, in a reward worker as the run does, before any model work: a wrong signature, a
  broken import or a crash is one line at start-up (`validate` reports it with the config's other
  problems).
- `RewardGuard.check_step` reads the pool's per-reward counts (`RewardPool.reward_stats`) after each
  step's scoring and stops the run (`RewardFailureError`, exit status 2) when one reward failed
  (raised, returned a non-finite value, timed out or killed its worker) on every completion of the
  step, or on more than `rl.reward_failure_fraction` of the completions of the last WINDOW_STEPS
  steps. It is called before the step trains, so the checkpoints on disk hold only steps trained
  on working rewards.
"""

from __future__ import annotations

import collections
from typing import Any, Sequence

from qerl_jax import reward_pool, rewards
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
    """Problems of scoring `sample_completion` of `row` (a dataset row: prompt, answer, other columns)
    once with each reward of `spec`, as the run scores completions: in a reward worker, within
    `timeout_s`. One "rl.reward = ...: ..." line per reward that raises, returns a non-number, runs
    past the timeout, kills its worker or does not import there."""
    names = [name for name, _ in rewards.parse_reward_spec(spec, weights)]
    fields = {"index": 0, **{k: v for k, v in row.items() if k != "answer"}}
    try:
        with reward_pool.RewardPool(1, timeout_s=timeout_s) as pool:
            pool.score_each([sample_completion(row["answer"])], [row["answer"]], names, fields=[fields])
    except RuntimeError as e:  # the worker itself does not start
        return [f"rl.reward = {spec!r}: a reward worker does not start: {_one_line(e)}"]
    return [
        f"rl.reward = {spec!r}: {name}(completion, answer, ...) on data.train's first row failed: "
        f"{pool.first_errors[name]}"
        for name in names
        if pool.reward_stats[name]["failed"]
    ]


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
        # A copy first: the pool's scheduler thread may add a reward's entry while the rollout runs.
        return {name: (c["items"], c["failed"]) for name, c in list(self.pool.reward_stats.items())}

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
