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


SLEEPY = "worker_rewards:sleepy_exact"  # imported by name in the workers (this module imports pytest, numpy)


def _wait_until_workers_ready(p: P.RewardPool, limit_s: float = 300.0) -> None:
    """Scores tiny batches until every worker has said it is ready (the scheduler reads that while it
    runs), so that which worker takes which item below does not hang on a start-up."""
    t_end = time.monotonic() + limit_s
    while not all(w.ready for w in p._workers):
        assert time.monotonic() < t_end, "reward workers not ready"
        np.testing.assert_array_equal(p.score(["a"], ["a"], SLEEPY), [1.0])
        time.sleep(0.1)


def test_a_slow_item_does_not_hold_back_a_later_batch():
    """Items of all batches share the workers: a fast batch submitted after one whose item runs to its
    deadline is done while that item still runs; the slow item then scores 0 as a timeout."""
    with P.RewardPool(2, timeout_s=5.0) as p:
        _wait_until_workers_ready(p)
        scored_before = p.stats["scored"]
        done = []
        slow = p.submit(["sleep 30"], ["sleep 30"], SLEEPY)
        fast = p.submit(["a", "b", "c", "d"], ["a", "x", "c", "d"], SLEEPY)
        slow.add_done_callback(lambda _: done.append("slow"))
        fast.add_done_callback(lambda _: done.append("fast"))
        np.testing.assert_array_equal(fast.result(timeout=10), [1.0, 0.0, 1.0, 1.0])
        assert not slow.done()  # its item has 5 s to run, the fast ones took milliseconds
        np.testing.assert_array_equal(slow.result(timeout=60), [0.0])
        assert done == ["fast", "slow"]
        assert p.stats["timeouts"] == 1 and p.stats["scored"] == scored_before + 4
        assert p.reward_stats[SLEEPY]["failed"] == 1
        assert p.first_errors[SLEEPY] == "timed out: ran past 5 s"


def test_small_batches_from_two_threads_score_as_one_batch(pool):
    """Many small batches (1-3 completions, two rewards each) submitted at once from two threads give
    the scores of one score_each call over all their items."""
    rng = random.Random(1)
    completions = [f"so \\boxed{{{rng.randint(0, 9)}}} {'7' * rng.randint(0, 9)}" for _ in range(60)]
    answers = [str(rng.randint(0, 9)) for _ in completions]
    rewards = ["accuracy", "worker_rewards:digit_reward"]
    want = pool.score_each(completions, answers, rewards)
    assert 0 < want[0].sum() < len(completions)  # both outcomes occur
    cuts = [0]
    while cuts[-1] < len(completions):
        cuts.append(min(len(completions), cuts[-1] + rng.randint(1, 3)))
    spans = list(zip(cuts[:-1], cuts[1:]))

    def submit_every_other(parity: int) -> list:
        return [
            (a, pool.submit_each(completions[a:b], answers[a:b], rewards))
            for a, b in spans[parity::2]
        ]

    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        submitted = [f for part in ex.map(submit_every_other, (0, 1)) for f in part]
    got = np.zeros_like(want)
    for a, fut in submitted:
        scores = fut.result(timeout=120)
        got[:, a : a + scores.shape[1]] = scores
    np.testing.assert_array_equal(got, want)


def test_close_finishes_the_pending_batches():
    p = P.RewardPool(1, timeout_s=30.0)
    procs = [w.proc for w in p._workers]
    futs = [p.submit([f"sleep 0.5 {b}{i}" for i in range(2)], [f"sleep 0.5 {b}0", "x"], SLEEPY) for b in range(3)]
    assert not futs[-1].done()  # 6 items of 0.5 s each on one worker
    assert not futs[-1].cancel()  # queued items are scored
    p.close()
    for fut in futs:
        assert fut.done()
        np.testing.assert_array_equal(fut.result(), [1.0, 0.0])
    assert all(proc.poll() is not None for proc in procs)
    assert p.stats["scored"] == 6 and p.stats["timeouts"] == 0


def test_workers_not_ready_in_time_fail_every_pending_batch():
    with P.RewardPool(1, startup_timeout_s=0.01) as p:  # a worker takes far longer to start
        futs = [p.submit(["a"], ["a"], SLEEPY) for _ in range(3)]
        for fut in futs:
            with pytest.raises(RuntimeError, match="not ready after"):
                fut.result(timeout=60)
        assert not p.stats and not p.reward_stats  # nothing was scored or counted


def test_a_worker_imports_neither_jax_nor_the_model_code():
    """What a worker runs (`_WORKER_CMD`'s import) leaves JAX out: each run starts its workers anew,
    and the package's public API (the model loader, JAX) would double their start-up."""
    import subprocess
    import sys

    check = "import sys; from qerl_jax.reward_pool import _worker_loop; print(sorted({'jax', 'qerl_jax.models'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", check], env=P._worker_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout
