"""Tests for qerl_jax.rewards: extraction, equivalence cases, the process pool."""

import concurrent.futures
import fractions
import json
import os
import pathlib
import random
import re
import signal
import threading
import time

import numpy as np
import pytest

from qerl_jax import rewards as R
from qerl_jax import tiny

CASES_PATH = pathlib.Path(__file__).with_name("reward_cases.jsonl")
CASES = [json.loads(line) for line in CASES_PATH.read_text().splitlines() if line.strip()]
_DATA = tiny.default_data_dir()
MATH500 = (_DATA / "math500" / "test.jsonl") if _DATA else pathlib.Path("/nonexistent")


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


def _prompt_reward(completion: str, answer: str, prompt: str, *, source_id: str = "") -> float:
    """Test reward naming two row fields: the prompt's length, + 100 for source_id "gold"."""
    return len(prompt) + (100.0 if source_id == "gold" else 0.0)


def _row_reward(completion: str, answer: str, **row) -> float:
    """Test reward taking every field: the row's index; raises on "boom"."""
    if completion == "boom":
        raise ValueError("boom")
    return float(row["index"])


@pytest.fixture(scope="module")
def pool():
    with R.RewardPool(2, timeout_s=20.0) as p:
        yield p


# ---------------------------------------------------------------- cases file


def test_cases_file_covers_enough():
    assert len(CASES) >= 60
    notes = " ".join(c["note"] for c in CASES)
    for word in (
        "comma",
        "dollar",
        "unit",
        "negative",
        "decimal",
        "18.0",
        "dfrac",
        "sqrt",
        "interval",
        "tuple",
        "text",
        "degrees",
        "percent",
        "last box",
        "unbalanced",
    ):
        assert word in notes, word


@pytest.mark.parametrize("case", CASES, ids=[c["note"] for c in CASES])
def test_reward_case_inline(case):
    fn = R.get_reward_fn(case["reward"])
    assert fn(case["completion"], case["ground_truth"]) == pytest.approx(case["expected"])


def test_reward_cases_through_pool(pool):
    for name in sorted({c["reward"] for c in CASES}):
        sub = [c for c in CASES if c["reward"] == name]
        got = pool.score([c["completion"] for c in sub], [c["ground_truth"] for c in sub], name)
        assert got.dtype == np.float32 and got.shape == (len(sub),)
        np.testing.assert_allclose(got, [c["expected"] for c in sub], atol=1e-6)


# ---------------------------------------------------------------- extraction


@pytest.mark.parametrize(
    "text,expected",
    [
        ("no box here", None),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("a \\boxed{1} b \\boxed{2} c", "2"),
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),  # Escaped braces are content.
        ("\\boxed{a}\\fbox{b}", "b"),
        ("\\boxed  {x}", "x"),
        ("\\boxed 42$.", "42"),
        ("\\boxed{1} and \\boxed{2", None),  # The last box is never closed.
        ("\\boxedfoo{3}", None),  # Not a \boxed command.
        ("\\boxed{}", ""),
    ],
)
def test_extract_last_boxed(text, expected):
    assert R.extract_last_boxed(text) == expected


@pytest.mark.parametrize(
    "text,expected",
    [
        ("I have 3 apples and 12 pears.", "12"),
        ("Total: $1,200.", "1,200"),
        ("x = -7", "-7"),
        ("3-4 hours", "4"),
        ("pi is 3.14.", "3.14"),
        ("\u22125 degrees", "-5"),
        ("nothing", None),
    ],
)
def test_last_number(text, expected):
    assert R.last_number(text) == expected


@pytest.mark.parametrize(
    "s,lenient,expected",
    [
        ("18", False, 18),
        ("18.0", False, 18),
        ("-3.5", False, fractions.Fraction(-7, 2)),
        ("1,234,567", False, 1234567),
        ("$12", False, 12),
        ("12.", False, 12),
        ("1,23", False, None),
        ("18 dollars", False, None),
        ("18 dollars", True, 18),
        ("\\$18.50", True, fractions.Fraction(37, 2)),
        ("25\\%", True, 25),
        ("90^\\circ", True, 90),
        ("5x", True, None),
        ("\\frac{1}{2}", True, None),
        ("3 + 4", True, None),
        ("", True, None),
    ],
)
def test_parse_number(s, lenient, expected):
    assert R.parse_number(s, lenient=lenient) == expected


def test_math500_solutions_score_against_their_answers():
    if not MATH500.is_file():
        pytest.skip("shared MATH500 data not present")
    rows = [json.loads(line) for line in MATH500.read_text().splitlines()]
    got = [R.accuracy_reward(r["solution"], r["answer"]) for r in rows]
    assert sum(got) == len(rows)
    # Shifted answers are (almost always) wrong: the checker is not trivially true.
    wrong = [R.accuracy_reward("\\boxed{" + rows[i + 1]["answer"] + "}", rows[i]["answer"]) for i in range(60)]
    assert sum(wrong) <= 3


def test_accuracy_works_off_the_main_thread():
    # math-verify's signal timeouts refuse to run in threads; the reward must not.
    out = {}

    def run():
        out["r"] = R.accuracy_reward("so \\boxed{x^2+2x+1}", "(x+1)^2")
        out["w"] = R.accuracy_reward("so \\boxed{x^2+1}", "(x+1)^2")

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert out == {"r": 1.0, "w": 0.0}


def test_no_eval_of_model_output(monkeypatch):
    # sympy's parse_expr runs Python eval; model output must never reach it.
    from sympy.parsing import sympy_parser

    calls = []
    real = sympy_parser.eval_expr

    def spy(*args, **kwargs):
        calls.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(sympy_parser, "eval_expr", spy)
    sympy_parser.parse_expr("1+1")  # The spy is wired in.
    assert len(calls) == 1
    calls.clear()
    assert R.accuracy_reward("\\boxed{2+3}", "5") == 1.0
    assert R.accuracy_reward("The answer: 2*3+1", "\\frac{14}{2}") == 0.0
    assert R.accuracy_reward("\\boxed{__import__('os').getpid()}", "0") == 0.0
    assert R.accuracy_reward("\\boxed{(x+1)^2}", "x^2+2x+1") == 1.0
    # The LaTeX parser builds numbers through sympy.Number(text), which evals the
    # tokenized literal (e.g. "Integer (5 )"); nothing larger may get there.
    literal = re.compile(r"^\w+ \((?:'[\w.]*'|[\d.]+) \)$|^\w+ $")
    assert calls and all(literal.match(c) for c in calls), calls
    assert not any("import" in c or "getpid" in c for c in calls)


# ---------------------------------------------------------------- registry


def test_registry():
    assert {"accuracy", "format", "accuracy_format"} <= set(R.list_reward_fns())
    assert R.get_reward_fn("accuracy") is R.accuracy_reward
    with pytest.raises(ValueError, match="known: .*accuracy"):
        R.get_reward_fn("nope")
    with pytest.raises(ValueError, match="already registered"):
        R.register_reward("accuracy")(lambda c, a: 0.0)


# ---------------------------------------------------------------- pool


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
        R.RewardPool(0)


def test_score_batch_with_and_without_pool(pool):
    completions = ["\\boxed{1,000}", "The answer is 999.", "\\boxed{\\dfrac{3}{4}}"]
    answers = ["1000", "1000", "0.75"]
    np.testing.assert_array_equal(R.score_batch(completions, answers, pool=pool), [1, 0, 1])
    got = R.score_batch(completions, answers, "accuracy_format", num_workers=1)
    np.testing.assert_allclose(got, [1.1, 0.0, 1.1], rtol=1e-6)


def test_closed_pool_refuses_work():
    p = R.RewardPool(1)
    procs = [w.proc for w in p._workers]
    p.close()
    p.close()  # Idempotent.
    assert all(proc.poll() is not None for proc in procs)
    with pytest.raises(RuntimeError, match="closed"):
        p.submit(["a"], ["1"])


def test_call_reward_passes_the_fields_a_reward_names():
    fields = {"prompt": "abc", "source_id": "gold", "index": 7}
    assert R.call_reward(_prompt_reward, "x", "1", fields) == 103.0  # index not passed: not a parameter
    assert R.call_reward(_row_reward, "x", "1", fields) == 7.0  # **row takes every field
    assert R.call_reward(R.accuracy_reward, "\\boxed{1}", "1", fields) == 1.0  # (completion, answer) only
    with pytest.raises(TypeError):
        R.call_reward(_prompt_reward, "x", "1", {})  # its required prompt is missing


def test_parse_reward_spec():
    assert R.parse_reward_spec("accuracy") == [("accuracy", 1.0)]
    assert R.parse_reward_spec("accuracy, format", (1.0, 0.1)) == [("accuracy", 1.0), ("format", 0.1)]
    got = R.parse_reward_spec("test_rewards:_row_reward,format")
    assert got == [("test_rewards:_row_reward", 1.0), ("format", 1.0)]
    for spec, weights, match in (
        ("accuracy,format", (1.0,), "1 reward weights for the 2 rewards"),
        ("accuracy,accuracy", (), "twice"),
        ("accuracy,", (), "empty name"),
        ("accuracy,nope", (), "unknown reward function 'nope'"),
    ):
        with pytest.raises(ValueError, match=match):
            R.parse_reward_spec(spec, weights)


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
