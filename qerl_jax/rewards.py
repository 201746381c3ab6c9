"""Verifiable math rewards: answer extraction, equivalence checking, the reward registry.

A reward function takes (completion text, ground-truth answer string) and
returns a float; it may also name, as keyword parameters (or take **kwargs),
the prompt and the dataset row's other fields (`call_reward`). They are
registered by name (`get_reward_fn(name)`), so the choice is a config string;
"accuracy,format" names several, summed with weights (`parse_reward_spec`).

Safety: model output is never passed to `eval`/`exec`. Besides our own
regexes, only math-verify's LaTeX parser (antlr grammar) sees it, never its
plain-expression path (sympy `parse_expr`); the LaTeX parser hands sympy just
the text of single number tokens (via `sympy.Number`). Parsing and
comparison can still be slow on pathological strings, so batches are scored in
worker processes with a per-item deadline (`qerl_jax.reward_pool`).
"""

from __future__ import annotations

import fractions
import functools
import importlib
import inspect
import re
import threading
from typing import Any, Callable, Sequence

RewardFn = Callable[[str, str], float]

# math-verify's timeouts use signal.alarm, hence whole seconds.
MATH_VERIFY_TIMEOUT_S = 3
# A final answer longer than this is treated as no answer (bounds parse time).
MAX_ANSWER_CHARS = 1000

# --------------------------------------------------------------------------
# Registry.

_REGISTRY: dict[str, RewardFn] = {}


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator registering a module-level reward function under `name`."""

    def deco(fn: RewardFn) -> RewardFn:
        if name in _REGISTRY and _REGISTRY[name] is not fn:
            raise ValueError(f"reward function {name!r} is already registered.")
        _REGISTRY[name] = fn
        return fn

    return deco


def list_reward_fns() -> list[str]:
    return sorted(_REGISTRY)


def get_reward_fn(name: str) -> RewardFn:
    """The reward function `name`: a registered name, or "package.module:function".

    The second form lets a config use a user's own module-level reward function
    (it is imported here and, by reference, in the pool's worker processes).
    """
    if name in _REGISTRY:
        return _REGISTRY[name]
    if ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            fn = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"reward function {name!r} cannot be imported: {e}") from None
        if not callable(fn):
            raise ValueError(f"reward function {name!r} is not callable.")
        return fn
    raise ValueError(
        f"unknown reward function {name!r}; known: {', '.join(list_reward_fns())}, or 'package.module:function'."
    )


def parse_reward_spec(spec: str, weights: Sequence[float] = ()) -> list[tuple[str, float]]:
    """[(name, weight)] of a comma-separated reward spec ("accuracy,format"); weights () = 1 each.

    Each name must resolve (`get_reward_fn`); raises ValueError naming what is wrong.
    """
    names = [n.strip() for n in spec.split(",")]
    if not spec.strip() or any(not n for n in names):
        raise ValueError(f"reward spec {spec!r} has an empty name; expected e.g. 'accuracy' or 'accuracy,format'")
    if len(set(names)) != len(names):
        raise ValueError(f"reward spec {spec!r} names a reward twice")
    weights = tuple(weights) or (1.0,) * len(names)
    if len(weights) != len(names):
        raise ValueError(f"{len(weights)} reward weights for the {len(names)} rewards of {spec!r}")
    for name in names:
        get_reward_fn(name)
    return [(n, float(w)) for n, w in zip(names, weights)]


@functools.lru_cache(maxsize=64)
def _keyword_names(fn: Callable) -> frozenset[str] | None:
    """The keyword parameters `fn` takes after its first two, or None when it takes **kwargs."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # no signature (some builtins): positional only
        return frozenset()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return frozenset(p.name for p in params[2:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


def call_reward(fn: Callable, completion: str, answer: str, fields: dict[str, Any] | None = None) -> float:
    """fn(completion, answer, **fields), passing only the fields `fn` names (all if it takes **kwargs).

    fields: the prompt ("prompt") and the dataset row's other columns, e.g. "source_id".
    """
    names = _keyword_names(fn)
    fields = fields or {}
    return fn(completion, answer, **(fields if names is None else {k: v for k, v in fields.items() if k in names}))


# --------------------------------------------------------------------------
# Extraction.

_BOX_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")


def extract_last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` / `\\fbox{...}` (balanced braces).

    Also accepts the brace-less form `\\boxed 5`. Returns None when there is no
    box or the last one is never closed (e.g. a truncated completion). Escaped
    braces `\\{`, `\\}` inside the box are content, not grouping.
    """
    matches = list(_BOX_RE.finditer(text))
    if not matches:
        return None
    pos = matches[-1].end()
    n = len(text)
    while pos < n and text[pos] == " ":
        pos += 1
    if pos >= n:
        return None
    if text[pos] != "{":
        m = re.match(r"[^\s$]+", text[pos:])  # "\boxed 5" form.
        return m.group(0) if m else None
    depth, i, start = 0, pos, pos + 1
    while i < n:
        c = text[i]
        if c == "\\":
            i += 2  # Skip the escaped character (\{, \}, \\).
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
        i += 1
    return None


_NUMBER_RE = re.compile(
    r"(?:(?<![\w)\]])-)?(?:\d{1,3}(?:,\d{3})+(?![\d])|\d+)(?:\.\d+)?"
    r"|(?:(?<![\w)\]])-)?\.\d+"
)


def last_number(text: str) -> str | None:
    """The last number in `text` (thousands commas and sign kept), or None."""
    text = text.replace("\u2212", "-")
    numbers = _NUMBER_RE.findall(text)
    return numbers[-1] if numbers else None


# --------------------------------------------------------------------------
# Normalization.

_TEXT_WRAP_RE = re.compile(r"\\(?:text|textbf|textrm|mathrm|mathbf|mbox|textit)\s*\{([^{}]*)\}")
_STRICT_NUMBER_RE = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)?(?:\.\d*)?")
_UNIT_RE = re.compile(r"(?:[A-Za-z]{2,}|\s+[A-Za-z]+)(?:[\s.]*[A-Za-z]+)*\.?")


def _number_to_fraction(s: str) -> fractions.Fraction | None:
    if not s or not any(ch.isdigit() for ch in s):
        return None
    if "," in s and not re.fullmatch(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d*)?", s):
        return None
    try:
        return fractions.Fraction(s.replace(",", "").rstrip("."))
    except (ValueError, ZeroDivisionError):
        return None


def parse_number(s: str, *, lenient: bool = False) -> fractions.Fraction | None:
    """Parses a plain number as an exact Fraction, or None.

    Strict mode (ground truths): optional sign, thousands commas, decimal point,
    surrounding `$`, a trailing period. Lenient mode (predictions) additionally
    drops `\\$`, `%`, degrees, LaTeX spacing, `\\text{...}` wrappers and trailing
    unit words ("18 dollars", "5cm"); a single trailing letter ("5x") is not a unit.
    """
    s = s.strip().replace("\u2212", "-")
    if lenient:
        s = _TEXT_WRAP_RE.sub(lambda m: " " + m.group(1) + " ", s)
        for tok in (
            "\\$",
            "\\%",
            "%",
            "^{\\circ}",
            "^\\circ",
            "\\circ",
            "\u00b0",
            "\\!",
            "\\,",
            "\\;",
            "\\:",
            "\\ ",
            "~",
        ):
            s = s.replace(tok, " ")
    s = s.replace("$", " ").strip()
    if s.endswith("."):
        s = s[:-1].rstrip()
    m = _STRICT_NUMBER_RE.match(s)
    if not m or not m.group(0):
        return None
    num, rest = m.group(0), s[m.end() :]
    if rest and not (lenient and _UNIT_RE.fullmatch(rest)):
        return None
    return _number_to_fraction(num)


_STR_DROP = ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\displaystyle", "^{\\circ}", "^\\circ", "\\%", "%", "$")


def normalize_answer_str(s: str) -> str:
    """Conservative string normalization for exact-match comparison."""
    s = _TEXT_WRAP_RE.sub(lambda m: m.group(1), s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    for tok in _STR_DROP:
        s = s.replace(tok, "")
    s = "".join(s.split())
    return s.rstrip(".")


# --------------------------------------------------------------------------
# Equivalence.


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@functools.lru_cache(maxsize=1)
def _latex_config():
    import math_verify

    return [math_verify.LatexExtractionConfig()]


def _math_verify_equal(gold: str, pred: str, timeout_s: int | None) -> bool:
    """math-verify equivalence of two LaTeX answer strings (False on failure).

    Only the LaTeX extraction config is used: the plain-expression one goes
    through sympy's `parse_expr`, which evaluates Python code.
    """
    import math_verify

    # math-verify's alarm-based timeouts raise ValueError outside the main thread.
    t = timeout_s if _in_main_thread() else None
    try:
        gold_p = math_verify.parse(f"${gold}$", extraction_config=_latex_config(), parsing_timeout=t)
        if not gold_p:
            return False
        pred_p = math_verify.parse(f"${pred}$", extraction_config=_latex_config(), parsing_timeout=t)
        if not pred_p:
            return False
        return bool(math_verify.verify(gold_p, pred_p, timeout_seconds=t))
    except BaseException as e:  # TimeoutException derives from BaseException.
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        return False


def answers_match(pred: str, ground_truth: str, *, timeout_s: int = MATH_VERIFY_TIMEOUT_S) -> bool:
    """Whether an extracted answer equals the ground truth.

    Numbers compare exactly (GSM8K-style: commas, `$`, units, `18` == `18.0`);
    everything else through a normalized string match, then math-verify
    (numeric and symbolic equivalence, sets, intervals, tuples...).
    """
    pred = re.sub(r"(?<!\\)\$", "", pred).strip()
    if pred.endswith("."):
        pred = pred[:-1].rstrip()
    if not pred or len(pred) > MAX_ANSWER_CHARS:
        return False
    gold = ground_truth.strip()
    gold_num = parse_number(gold)
    if gold_num is not None:
        pred_num = parse_number(pred, lenient=True)
        if pred_num is not None:
            return pred_num == gold_num
    if normalize_answer_str(pred) == normalize_answer_str(gold):
        return True
    return _math_verify_equal(gold, pred, timeout_s)


def extract_answer(completion: str, ground_truth: str) -> str | None:
    """The answer a completion gives: its last box; if it has no box at all and
    the ground truth is a plain number (GSM8K-style), the last number in the text.
    None when there is no answer (or the last box is never closed)."""
    boxed = extract_last_boxed(completion)
    if boxed is not None:
        return boxed
    if _BOX_RE.search(completion):
        return None  # A box that is never closed: malformed, no fallback.
    if parse_number(ground_truth) is not None:
        return last_number(completion)
    return None


# --------------------------------------------------------------------------
# Reward functions.


DIGITS_REWARDED = 8


@register_reward("digits")
def digits_reward(completion: str, ground_truth: str) -> float:
    """The number of digit characters in the completion, up to 8, over 8 (the tiny demo's task).

    A reward a randomly initialised model earns a little of by chance and climbs within a few
    steps, so a tiny run shows learning; the ground truth is not used.
    """
    del ground_truth
    return min(sum(ch.isdigit() for ch in completion), DIGITS_REWARDED) / DIGITS_REWARDED


@register_reward("accuracy")
def accuracy_reward(completion: str, ground_truth: str) -> float:
    """1.0 if the completion's final answer equals the ground truth, else 0.0."""
    pred = extract_answer(completion, str(ground_truth))
    if pred is None:
        return 0.0
    return 1.0 if answers_match(pred, str(ground_truth)) else 0.0


@register_reward("format")
def format_reward(completion: str, ground_truth: str) -> float:
    """1.0 if the completion contains a closed `\\boxed{...}` answer, else 0.0."""
    del ground_truth
    boxed = extract_last_boxed(completion)
    return 1.0 if boxed is not None and boxed.strip() else 0.0


FORMAT_BONUS = 0.1


@register_reward("accuracy_format")
def accuracy_format_reward(completion: str, ground_truth: str) -> float:
    """accuracy + 0.1 * format: in {0, 0.1, 1, 1.1}."""
    return accuracy_reward(completion, ground_truth) + FORMAT_BONUS * format_reward(completion, ground_truth)
