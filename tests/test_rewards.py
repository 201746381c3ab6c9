"""Tests for qerl_jax.rewards: extraction, equivalence cases, the registry, reward specs."""

import fractions
import json
import pathlib
import re
import threading

import pytest

from qerl_jax import rewards as R
from qerl_jax.model_io import tiny

CASES_PATH = pathlib.Path(__file__).with_name("reward_cases.jsonl")
CASES = [json.loads(line) for line in CASES_PATH.read_text().splitlines() if line.strip()]
_DATA = tiny.default_data_dir()
MATH500 = (_DATA / "math500" / "test.jsonl") if _DATA else pathlib.Path("/nonexistent")


def _prompt_reward(completion: str, answer: str, prompt: str, *, source_id: str = "") -> float:
    """Test reward naming two row fields: the prompt's length, + 100 for source_id "gold"."""
    return len(prompt) + (100.0 if source_id == "gold" else 0.0)


def _row_reward(completion: str, answer: str, **row) -> float:
    """Test reward taking every field: the row's index; raises on "boom"."""
    if completion == "boom":
        raise ValueError("boom")
    return float(row["index"])


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
