"""Tests for qerl_jax.reward_pool: the worker processes, deadlines, crashes, several rewards."""

import concurrent.futures
import os
import random
import signal
import time

import numpy as np
import pytest
from test_rewards import CASES, _prompt_reward, _row_reward

from qerl_jax import reward_pool as P


def _sleepy_reward(completion: str, answer: str) -> float:
    """Test reward: hangs (uninterruptibly, no alarm is set) on "hang"."""
    if completion == "hang":
        time.sleep(600)
    return 1.0 if completion == answer else 0.0


def _raising_reward(completion: str, answer: str) -> float:
    if completion == "boom":
        raise RuntimeError("boom")
    return 0.5


def _dying_reward(completion: str, answer: str) -> float:
    """Test reward: its worker process is killed (as by the OOM killer) on "die"."""
    if completion == "die":
        os.kill(os.getpid(), signal.SIGKILL)
    return 1.0 if completion == answer else 0.0


@pytest.fixture(scope="module")
def pool():
    with P.RewardPool(2, timeout_s=20.0) as p:
        yield p


def test_reward_cases_through_pool(pool):
    for name in sorted({c["reward"] for c in CASES}):
        sub = [c for c in CASES if c["reward"] == name]
        got = pool.score([c["completion"] for c in sub], [c["ground_truth"] for c in sub], name)
        assert got.dtype == np.float32 and got.shape == (len(sub),)
        np.testing.assert_allclose(got, [c["expected"] for c in sub], atol=1e-6)


def test_long_garbage_returns_zero_quickly(pool):
    rng = random.Random(0)
    alphabet = "0123456789{}\\^_()[]+-*/=., abcxyz$"
    garbage = "".join(rng.choice(alphabet) for _ in range(300_000))
    completions = [
        garbage,
        "\\boxed{" + garbage,  # Never closed.
        "\\boxed{" + "{" * 50_000 + "1" + "}" * 50_000 + "}",  # Very deep nesting.
        "\\boxed{" + "\\frac{1}{" * 150 + "2" + "}" * 150 + "}",  # Deep but short.
        "\\boxed{9^{9^{9^{9^{9}}}}}",  # Power tower: huge if evaluated.
        "\\boxed{" + "(" * 400 + ")" * 400 + "}",
    ]
    t0 = time.monotonic()
    got = pool.score(completions, ["7"] * len(completions))
    assert time.monotonic() - t0 < 30.0
    np.testing.assert_array_equal(got, np.zeros(len(completions), np.float32))


def test_submit_returns_future_in_order(pool):
    n = 40
    completions = [f"step... \\boxed{{{i}}}" for i in range(n)]
    answers = [str(i if i % 3 else i + 1) for i in range(n)]
    fut = pool.submit(completions, answers)
    assert isinstance(fut, concurrent.futures.Future)
    got = fut.result(timeout=120)
    np.testing.assert_array_equal(got, [0.0 if i % 3 == 0 else 1.0 for i in range(n)])
    assert pool.score([], []).shape == (0,)


def test_timeout_kills_hung_worker_and_recovers(pool):
    # Each worker first imports this module to unpickle the reward fn: seconds on a loaded
    # CI machine, which must not count against the per-item limit below.
    np.testing.assert_array_equal(pool.score(["a", "b"], ["a", "x"], _sleepy_reward, timeout_s=60.0), [1.0, 0.0])
    timeouts_before = pool.stats["timeouts"]
    t0 = time.monotonic()
    got = pool.score(["hang", "a", "b", "c"], ["hang", "a", "x", "c"], _sleepy_reward, timeout_s=6.0)
    assert time.monotonic() - t0 < 60.0
    np.testing.assert_array_equal(got, [0.0, 1.0, 0.0, 1.0])
    assert pool.stats["timeouts"] == timeouts_before + 1
    # The replaced worker serves later batches.
    got = pool.score(["\\boxed{3}"] * 4, ["3"] * 4)
    np.testing.assert_array_equal(got, np.ones(4, np.float32))


def test_killed_worker_scores_zero_and_is_replaced(pool):
    crashes_before = pool.stats["crashes"]
    got = pool.score(["a", "die", "b", "c"], ["a", "die", "x", "c"], _dying_reward, timeout_s=60.0)
    np.testing.assert_array_equal(got, [1.0, 0.0, 0.0, 1.0])
    assert pool.stats["crashes"] == crashes_before + 1
    assert all(w.proc.poll() is None for w in pool._workers)  # the dead worker was replaced
    np.testing.assert_array_equal(pool.score(["\\boxed{3}"] * 4, ["3"] * 4), np.ones(4, np.float32))


def test_code_and_explosive_latex_score_zero_without_running(pool, tmp_path):
    """Completions that are code, LaTeX that blows up a parser or 1 MB answers score 0 within the
    pool's per-item limit, and nothing in them runs."""
    pwned = tmp_path / "PWNED"
    shell = f"__import__('os').system('touch {pwned}')"
    cases = [
        (shell, "-5"),  # GSM8K-style: the last number is taken, the text never evaluated
        (shell, "x^2"),
        ("\\boxed{" + shell + "}", "x"),  # math-verify's LaTeX parser sees it
        ("\\boxed{exec(\"import os; os.system('touch " + str(pwned) + "')\")}", "2"),
        ("\\boxed{(10^{10^{10}})!}", "3"),
        ("\\boxed{9^{9^{9^{9^{9^{9}}}}}}", "x+1"),
        ("\\boxed{100000000!}", "x"),
        ("\\boxed{\\binom{10^{10}}{10^{5}}}", "x"),
        ("\\boxed{\\sqrt{-1}^{10^{100}}}", "x"),
        ("\\boxed{" + "\\left(" * 2000 + "}", "x"),
        ("\\boxed{" + "1" * 1_000_000 + "}", "1"),  # a 1 MB answer
        ("x" * 1_000_000 + " so 1", "x"),
    ]
    t0 = time.monotonic()
    got = pool.score([c for c, _ in cases] + ["\\boxed{7}"], [a for _, a in cases] + ["7"])
    elapsed = time.monotonic() - t0
    np.testing.assert_array_equal(got, [0.0] * len(cases) + [1.0])
    assert not pwned.exists()
    # Two workers, each item cut at the pool's 20 s limit at worst (math-verify's own alarms stop
    # the slow ones after ~3 s).
    assert elapsed < 20.0 * (len(cases) + 1) / 2, elapsed


def test_reward_fn_exception_scores_zero(pool):
    errors_before = pool.stats["errors"]
    got = pool.score(["ok", "boom", "ok"], ["1", "1", "1"], _raising_reward)
    np.testing.assert_array_equal(got, [0.5, 0.0, 0.5])
    assert pool.stats["errors"] == errors_before + 1
    # per reward, by name: items, failures and the first failure's text (what reward_guard reads)
    name = P.reward_name(_raising_reward)
    assert name == "test_reward_pool:_raising_reward"
    assert pool.reward_stats[name]["items"] >= 3 and pool.reward_stats[name]["failed"] >= 1
    assert pool.first_errors[name] == "RuntimeError: boom"


def test_a_slow_reward_import_is_not_scoring_time():
    """The reward's module imports in 3 s (a worker unpickles it on its first item); a 1 s per-item
    timeout counts the scoring only, so nothing times out and every item scores."""
    import slow_import_reward

    with P.RewardPool(1, timeout_s=1.0) as p:
        got = p.score(["a", "b", "c"], ["a", "x", "c"], slow_import_reward.exact)
        np.testing.assert_array_equal(got, [1.0, 0.0, 1.0])
        assert p.stats["timeouts"] == 0
        assert p.reward_stats["slow_import_reward:exact"] == {"items": 3}


def test_failures_are_recorded_per_reward_with_their_first_text():
    with P.RewardPool(1, timeout_s=3.0) as p:
        p.score(["hang", "a"], ["hang", "a"], _sleepy_reward)
        p.score(["die", "a"], ["die", "a"], _dying_reward)
    hang, die = P.reward_name(_sleepy_reward), P.reward_name(_dying_reward)
    assert dict(p.reward_stats[hang]) == {"items": 2, "failed": 1}
    assert p.first_errors[hang] == "timed out: ran past 3 s"
    assert dict(p.reward_stats[die]) == {"items": 2, "failed": 1}
    assert p.first_errors[die] == f"its worker process died (exit code {-signal.SIGKILL})"


def test_pool_bad_input(pool):
    with pytest.raises(ValueError, match="2 completions but 1 answers"):
        pool.submit(["a", "b"], ["1"])
    with pytest.raises(TypeError, match=r"answers\[1\] is int"):
        pool.submit(["a", "b"], ["1", 2])
    with pytest.raises(ValueError, match="cannot be sent"):
        pool.submit(["a"], ["1"], lambda c, a: 1.0)
    with pytest.raises(ValueError, match="unknown reward function"):
        pool.submit(["a"], ["1"], "nope")
    with pytest.raises(ValueError, match="num_workers"):
        P.RewardPool(0)


def test_score_batch_with_and_without_pool(pool):
    completions = ["\\boxed{1,000}", "The answer is 999.", "\\boxed{\\dfrac{3}{4}}"]
    answers = ["1000", "1000", "0.75"]
    np.testing.assert_array_equal(P.score_batch(completions, answers, pool=pool), [1, 0, 1])
    got = P.score_batch(completions, answers, "accuracy_format", num_workers=1)
    np.testing.assert_allclose(got, [1.1, 0.0, 1.1], rtol=1e-6)


def test_closed_pool_refuses_work():
    p = P.RewardPool(1)
    procs = [w.proc for w in p._workers]
    p.close()
    p.close()  # Idempotent.
    assert all(proc.poll() is not None for proc in procs)
    with pytest.raises(RuntimeError, match="closed"):
        p.submit(["a"], ["1"])


def test_score_each_runs_every_reward_with_the_row_fields_in_the_workers(pool):
    completions = ["\\boxed{3}", "boom", "no"]
    fields = [{"prompt": "p" * (i + 1), "source_id": "gold" if i == 2 else "s", "index": 10 + i} for i in range(3)]
    errors_before = pool.stats["errors"]
    got = pool.score_each(
        completions, ["3", "3", "3"], ["accuracy", _prompt_reward, _row_reward], fields=fields
    )
    assert got.shape == (3, 3) and got.dtype == np.float32
    np.testing.assert_array_equal(got[0], [1.0, 0.0, 0.0])  # accuracy
    np.testing.assert_array_equal(got[1], [1.0, 2.0, 103.0])  # len(prompt) + 100 for "gold"
    np.testing.assert_array_equal(got[2], [10.0, 0.0, 12.0])  # "boom" raised: 0 for that item only
    assert pool.stats["errors"] == errors_before + 1
    with pytest.raises(ValueError, match="3 completions but 2 field dicts"):
        pool.submit_each(completions, ["3"] * 3, ["accuracy"], fields=fields[:2])
