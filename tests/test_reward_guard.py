"""qerl_jax.reward_guard: a reward called once on a dataset row at start-up, and a run stopped when a
reward fails on every completion of a step or on too many over a window."""

import collections
import os
import subprocess
import sys

import pytest
from conftest import REPO

from qerl_jax import reward_guard
from qerl_jax.reward_guard import RewardFailureError, RewardGuard

ROW = {"prompt": "What is 2 + 3?", "answer": "5", "source_id": "gsm8k/train/0"}


def boxed_only(completion: str, ground_truth: str) -> float:
    """Parses the boxed answer only; raises on anything else (a model's free text)."""
    if "\\boxed{" not in completion:
        raise ValueError("no boxed answer")
    return float(completion.split("\\boxed{")[1].split("}")[0] == ground_truth)


def with_source(completion: str, ground_truth: str, source_id: str) -> float:
    return float(source_id.startswith("gsm8k"))


def returns_none(completion: str, ground_truth: str):
    return None


def sleeps(completion: str, ground_truth: str) -> float:
    import time

    time.sleep(30)
    return 0.0


def kills_its_process(completion: str, ground_truth: str) -> float:
    import signal

    os.kill(os.getpid(), signal.SIGKILL)
    return 0.0


def test_working_rewards_have_no_problem_on_the_sample_row():
    spec = "accuracy,test_reward_guard:boxed_only,test_reward_guard:with_source"
    assert reward_guard.sample_row_problems(spec, (), ROW, timeout_s=10.0) == []


@pytest.mark.parametrize(
    "spec, needle",
    [
        ("os:getcwd", "os:getcwd(completion, answer, ...) on data.train's first row failed: TypeError: "),
        ("test_reward_guard:returns_none", "failed: TypeError: float() argument must be"),
        ("math:sqrt", "failed: TypeError"),
        ("test_reward_guard:kills_its_process", f"failed: its worker process died (exit code {-9})"),
    ],
)
def test_a_broken_reward_is_one_line_naming_it(spec, needle):
    (problem,) = reward_guard.sample_row_problems(spec, (), ROW, timeout_s=10.0)
    assert problem.startswith(f"rl.reward = {spec!r}: ") and needle in problem and "\n" not in problem


def test_a_reward_that_raises_on_every_completion_is_one_line_at_start_up(tmp_path):
    """`--config.rl.reward=os:getcwd` (today: exit 0, a full run, every reward 0): refused before the
    model is built or anything is written."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "qerl_jax.main", "--config=configs/tiny.py", f"--config.workdir={run}",
           "--config.rl.reward=os:getcwd"]  # fmt: skip
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr and "memory plan" not in out.stdout, out.stderr[-3000:]
    (line,) = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert line.startswith("error: rl.reward = 'os:getcwd': os:getcwd(completion, answer, ...) on data.train's first "
                           "row failed: TypeError: "), line  # fmt: skip
    assert not run.exists()


def test_a_reward_that_hangs_on_the_sample_row_is_cut_at_the_timeout():
    (problem,) = reward_guard.sample_row_problems("accuracy,test_reward_guard:sleeps", (), ROW, timeout_s=0.5)
    assert problem == (
        "rl.reward = 'accuracy,test_reward_guard:sleeps': test_reward_guard:sleeps(completion, answer, ...) on "
        "data.train's first row failed: timed out: ran past 0.5 s"
    )


class FakePool:
    """The two things the guard reads of a RewardPool."""

    def __init__(self):
        self.reward_stats = collections.defaultdict(collections.Counter)
        self.first_errors = {}

    def score(self, name: str, items: int, failed: int, error: str = "ValueError: bad"):
        self.reward_stats[name]["items"] += items
        self.reward_stats[name]["failed"] += failed
        if failed:
            self.first_errors.setdefault(name, error)


def test_a_reward_failing_on_every_completion_of_a_step_stops_the_run(tmp_path):
    pool = FakePool()
    pool.score("accuracy", 16, 0)
    guard = RewardGuard(pool, 0.5, str(tmp_path / "checkpoints"))  # counts before it are not a step's
    pool.score("accuracy", 16, 0)
    pool.score("mine:fn", 16, 3, "KeyError: 'x'")
    guard.check_step(0)  # 3 of 16: goes on
    pool.score("accuracy", 16, 0)
    pool.score("mine:fn", 16, 16)
    with pytest.raises(RewardFailureError) as e:
        guard.check_step(1)
    assert e.value.exit_code == 2
    assert str(e.value) == (
        "reward 'mine:fn' failed on every one of the 16 completions of step 1 (first error: KeyError: 'x'); "
        "stopped, no checkpoint was written yet"
    )


def test_too_many_failures_over_the_window_stop_the_run_and_name_the_kept_checkpoint(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    for step in ("3", "6", "6.orbax-checkpoint-tmp-1"):
        os.makedirs(checkpoints / step)
    pool = FakePool()
    guard = RewardGuard(pool, 0.5, str(checkpoints), window_steps=3)
    for step, failed in enumerate([8, 8, 4, 8]):  # 8 of 16 is not more than half; the window's share is
        pool.score("r", 16, failed, "timed out: ran past 10 s")
        guard.check_step(step)
    pool.score("r", 16, 15)  # window (steps 2-4): 4 + 8 + 15 = 27 of 48
    with pytest.raises(RewardFailureError, match=r"failed on 27 of the 48 completions of steps 2-4, more than "
                       r"rl.reward_failure_fraction = 0.5 \(first error: timed out: ran past 10 s\); stopped, the "
                       r"last checkpoint \(step 6\) in .*checkpoints is kept"):
        guard.check_step(4)


def test_a_step_without_scoring_and_a_fraction_of_one_never_stop(tmp_path):
    pool = FakePool()
    guard = RewardGuard(pool, 1.0, str(tmp_path))
    guard.check_step(0)  # nothing scored (every prompt too long)
    pool.score("r", 16, 15)
    guard.check_step(1)  # 15 of 16 failed: only a step where every completion fails stops it at 1.0
