"""A generated arithmetic task: a + b, a - b and a * b with 1- to 3-digit operands.

    load_math_dataset("arithmetic:train")   # or "arithmetic:test": the same schema as GSM8K rows

Problems are drawn from one seeded stream (operation and each operand's digit count uniform,
so difficulty is mixed: 2 + 3 up to 947 * 286), deduplicated (a + b and b + a count as one
problem), and split once: the first `num_test` problems are the test split, the next
`num_train` the train split. So the split is fixed, the two never overlap, and both are the
same on every machine. Subtraction puts the larger operand first (answers are never negative).
Answers are the exact integers as strings, which `rewards.accuracy_reward` checks (the last
\\boxed{} of a completion, else its last number).
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Callable

import numpy as np

PREFIX = "arithmetic:"
SPLITS = ("train", "test")
OPERATIONS: dict[str, Callable[[int, int], int]] = {"+": operator.add, "-": operator.sub, "*": operator.mul}
# The prompt of configs/arithmetic_smollm2.py: the bare problem as the user message, under the
# chat template's default system prompt (see that config for the templates compared).
USER_TEMPLATE = "{prompt}"
SYSTEM_PROMPT = None


@dataclasses.dataclass(frozen=True)
class ArithmeticSpec:
    """What `arithmetic_rows` generates; the defaults define "arithmetic:train" / "arithmetic:test"."""

    num_train: int = 20000
    num_test: int = 500
    seed: int = 0
    max_digits: int = 3
    operations: tuple[str, ...] = ("+", "-", "*")


@dataclasses.dataclass(frozen=True)
class Problem:
    a: int
    op: str
    b: int

    @property
    def answer(self) -> int:
        return OPERATIONS[self.op](self.a, self.b)

    @property
    def text(self) -> str:
        return f"What is {self.a} {self.op} {self.b}?"

    def key(self) -> tuple[int, str, int]:
        """Identity up to commutativity."""
        return (min(self.a, self.b), self.op, max(self.a, self.b)) if self.op in "+*" else (self.a, self.op, self.b)


def _operand(rng: np.random.Generator, digits: int) -> int:
    lo = 0 if digits == 1 else 10 ** (digits - 1)
    return int(rng.integers(lo, 10**digits))


def problems(spec: ArithmeticSpec = ArithmeticSpec()) -> list[Problem]:
    """The spec's num_test + num_train distinct problems, in their seeded order."""
    unknown = [op for op in spec.operations if op not in OPERATIONS]
    if unknown or not spec.operations:
        raise ValueError(f"ArithmeticSpec.operations {spec.operations!r}: expected a subset of {tuple(OPERATIONS)}")
    if spec.max_digits < 1:
        raise ValueError(f"ArithmeticSpec.max_digits must be >= 1, got {spec.max_digits}")
    rng = np.random.default_rng(spec.seed)
    want = spec.num_test + spec.num_train
    out: list[Problem] = []
    seen: set[tuple[int, str, int]] = set()
    for _ in range(50 * want):  # bounded: a tiny spec (1 digit, one op) has few distinct problems
        if len(out) == want:
            break
        op = spec.operations[int(rng.integers(len(spec.operations)))]
        a = _operand(rng, int(rng.integers(1, spec.max_digits + 1)))
        b = _operand(rng, int(rng.integers(1, spec.max_digits + 1)))
        p = Problem(max(a, b), op, min(a, b)) if op == "-" else Problem(a, op, b)
        if p.key() not in seen:
            seen.add(p.key())
            out.append(p)
    if len(out) < want:
        raise ValueError(f"{spec} has only {len(out)} distinct problems; {want} requested")
    return out


def arithmetic_rows(split: str, spec: ArithmeticSpec = ArithmeticSpec()) -> list[dict[str, str]]:
    """Rows {"question", "answer", "id"} of one split (the schema `convert_row` maps)."""
    if split not in SPLITS:
        raise ValueError(f"arithmetic split {split!r} is unknown; expected one of {SPLITS}")
    all_problems = problems(spec)
    chosen = all_problems[: spec.num_test] if split == "test" else all_problems[spec.num_test :]
    return [
        {"question": p.text, "answer": str(p.answer), "id": f"arithmetic/{split}/{i}"} for i, p in enumerate(chosen)
    ]


def parse_name(name: str) -> str | None:
    """ "arithmetic:train" -> "train"; None when `name` is not an arithmetic source; ValueError for a bad split."""
    if not name.startswith(PREFIX):
        return None
    split = name[len(PREFIX) :]
    if split not in SPLITS:
        raise ValueError(
            f"dataset {name!r}: unknown arithmetic split {split!r}; expected arithmetic:train or arithmetic:test"
        )
    return split
