"""Verifiable math rewards: answer extraction, equivalence checking, scoring pool.

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
worker processes (`RewardPool`) with a per-item deadline: a worker that runs
past it is killed and replaced, and the item scores 0.0. Inside a worker the
reward runs in the main thread, where math-verify's own signal-based timeouts
work as well.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import fractions
import functools
import importlib
import inspect
import logging
import math
import os
import pickle
import re
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from typing import Any, Callable, Sequence

import numpy as np

log = logging.getLogger(__name__)

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


# --------------------------------------------------------------------------
# Process pool.
#
# Workers are plain `python -c` subprocesses speaking length-prefixed pickle
# frames over stdin/stdout. Unlike multiprocessing's spawn/forkserver, this
# never re-imports the caller's __main__ (works from unguarded scripts and
# notebooks), and unlike fork it is safe in a process running JAX threads.


def _resolve(reward_fn: str | RewardFn) -> RewardFn:
    return get_reward_fn(reward_fn) if isinstance(reward_fn, str) else reward_fn


_HEADER = 8  # Frame header: payload length, little-endian uint64.


def _write_frame(fd: int, obj: Any) -> None:
    payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    data = memoryview(len(payload).to_bytes(_HEADER, "little") + payload)
    while data:
        n = os.write(fd, data)
        data = data[n:]


def _read_exact(fd: int, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = os.read(fd, left)
        if not chunk:
            raise EOFError("pipe closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _read_frame(fd: int) -> Any:
    n = int.from_bytes(_read_exact(fd, _HEADER), "little")
    return pickle.loads(_read_exact(fd, n))


def _worker_loop() -> None:
    """Worker entry point: frames (fn, idx, completion, answer, fields) -> (idx, reward, err)."""
    in_fd, out_fd = 0, os.dup(1)
    os.dup2(2, 1)  # Stray prints from libraries must not corrupt the frame stream.
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's business.
    try:
        accuracy_reward("\\boxed{\\frac{1}{2}}", "0.5")  # Import and warm math-verify.
        _write_frame(out_fd, ("ready", None, None))
    except BaseException:
        _write_frame(out_fd, ("failed", None, traceback.format_exc()))
        return
    while True:
        try:
            msg = _read_frame(in_fd)
        except (EOFError, OSError):
            return
        if msg is None:
            return
        idx, err, r = -1, None, 0.0
        try:
            fn, idx, completion, answer, fields = msg
            r = float(call_reward(fn, completion, answer, fields))
            if not math.isfinite(r):
                err, r = f"non-finite reward {r}", 0.0
        except BaseException as e:  # Includes math-verify's TimeoutException.
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            err, r = f"{type(e).__name__}: {e}"[:500], 0.0
        _write_frame(out_fd, (idx, r, err))


_WORKER_CMD = "from qerl_jax.rewards import _worker_loop; _worker_loop()"


def _worker_env() -> dict[str, str]:
    env = dict(os.environ)
    # The parent's import path (e.g. a test folder holding a custom reward fn).
    paths = [p for p in sys.path if p and os.path.isdir(p)]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    # Workers never need an accelerator: keep JAX (if imported) off the GPU.
    env["JAX_PLATFORMS"] = "cpu"
    env["CUDA_VISIBLE_DEVICES"] = ""
    return env


@dataclasses.dataclass
class _Worker:
    proc: subprocess.Popen
    started: float
    ready: bool = False

    @property
    def out_fd(self) -> int:
        return self.proc.stdout.fileno()

    @property
    def in_fd(self) -> int:
        return self.proc.stdin.fileno()


def _default_num_workers() -> int:
    return max(1, min(8, (os.cpu_count() or 2) // 2))


class RewardPool:
    """Scores (completion, answer) batches in worker processes with a per-item timeout.

    Workers are started once and reused; a worker exceeding `timeout_s` on an
    item is killed and replaced, and that item scores 0.0 (counted in
    `stats["timeouts"]`). Batches run one at a time in a background thread, so
    `submit` returns a future at once and the caller can overlap work.
    Use as a context manager or call `close()`.
    """

    def __init__(self, num_workers: int | None = None, *, timeout_s: float = 10.0, startup_timeout_s: float = 300.0):
        if num_workers is None:
            num_workers = _default_num_workers()
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}.")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}.")
        self.num_workers = num_workers
        self.timeout_s = float(timeout_s)
        self.startup_timeout_s = float(startup_timeout_s)
        self.stats = collections.Counter()  # scored / timeouts / errors / crashes.
        self._env = _worker_env()
        self._lock = threading.Lock()
        self._closed = False
        self._workers = [self._start_worker() for _ in range(num_workers)]
        self._dispatcher = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="reward-pool")

    def _start_worker(self) -> _Worker:
        proc = subprocess.Popen(
            [sys.executable, "-c", _WORKER_CMD],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=self._env,
            close_fds=True,
        )
        return _Worker(proc, time.monotonic())

    @staticmethod
    def _stop_worker(w: _Worker, kill: bool) -> None:
        if not kill:
            try:
                _write_frame(w.in_fd, None)
            except (OSError, ValueError):
                kill = True
        if not kill:
            try:
                w.proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                kill = True
        if kill:
            w.proc.kill()
            w.proc.wait()
        for f in (w.proc.stdin, w.proc.stdout):
            try:
                f.close()
            except OSError:
                pass

    def _replace(self, k: int) -> None:
        self._stop_worker(self._workers[k], kill=True)
        self._workers[k] = self._start_worker()

    def submit(
        self,
        completions: Sequence[str],
        answers: Sequence[str],
        reward_fn: str | RewardFn = "accuracy",
        *,
        timeout_s: float | None = None,
        fields: Sequence[dict[str, Any]] | None = None,
    ) -> concurrent.futures.Future:
        """Starts scoring a batch; the future yields float32 rewards [len(completions)].

        `timeout_s` overrides the pool's per-item timeout for this batch; `fields`: per item, the
        keyword fields `call_reward` may pass (the prompt, the dataset row's other columns).
        """
        return self.submit_each(completions, answers, [reward_fn], timeout_s=timeout_s, fields=fields, _squeeze=True)

    def submit_each(
        self,
        completions: Sequence[str],
        answers: Sequence[str],
        reward_fns: Sequence[str | RewardFn],
        *,
        timeout_s: float | None = None,
        fields: Sequence[dict[str, Any]] | None = None,
        _squeeze: bool = False,
    ) -> concurrent.futures.Future:
        """Like `submit` for several rewards at once: the future yields float32 [len(reward_fns), N].

        Every (reward, item) pair is one work item with its own deadline; one that raises, times
        out or crashes its worker scores 0.0 and is counted in `stats`.
        """
        if self._closed:
            raise RuntimeError("RewardPool is closed.")
        completions, answers = list(completions), list(answers)
        if len(completions) != len(answers):
            raise ValueError(f"got {len(completions)} completions but {len(answers)} answers.")
        fields = [{} for _ in completions] if fields is None else [dict(f) for f in fields]
        if len(fields) != len(completions):
            raise ValueError(f"got {len(completions)} completions but {len(fields)} field dicts.")
        for name, seq in (("completions", completions), ("answers", answers)):
            bad = [i for i, x in enumerate(seq) if not isinstance(x, str)]
            if bad:
                raise TypeError(f"{name}[{bad[0]}] is {type(seq[bad[0]]).__name__}, expected str.")
        fns = [_resolve(f) for f in reward_fns]
        for fn in fns:
            try:
                pickle.dumps(fn)
            except Exception as e:
                raise ValueError(
                    f"reward_fn {fn!r} cannot be sent to worker processes ({e}); use a "
                    "registered name or a module-level function."
                ) from e
        try:
            pickle.dumps(fields)
        except Exception as e:
            raise ValueError(f"reward fields cannot be sent to worker processes ({e}).") from e
        timeout_s = self.timeout_s if timeout_s is None else float(timeout_s)
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}.")
        run = lambda: self._run(fns, completions, answers, fields, timeout_s)  # noqa: E731
        return self._dispatcher.submit((lambda: run()[0]) if _squeeze else run)

    def score(
        self,
        completions: Sequence[str],
        answers: Sequence[str],
        reward_fn: str | RewardFn = "accuracy",
        *,
        timeout_s: float | None = None,
        fields: Sequence[dict[str, Any]] | None = None,
    ) -> np.ndarray:
        """Blocking `submit(...).result()`: float32 rewards [len(completions)]."""
        return self.submit(completions, answers, reward_fn, timeout_s=timeout_s, fields=fields).result()

    def score_each(
        self,
        completions: Sequence[str],
        answers: Sequence[str],
        reward_fns: Sequence[str | RewardFn],
        *,
        timeout_s: float | None = None,
        fields: Sequence[dict[str, Any]] | None = None,
    ) -> np.ndarray:
        """Blocking `submit_each(...).result()`: float32 rewards [len(reward_fns), len(completions)]."""
        return self.submit_each(completions, answers, reward_fns, timeout_s=timeout_s, fields=fields).result()

    def _run(
        self,
        fns: list[RewardFn],
        completions: list[str],
        answers: list[str],
        fields: list[dict[str, Any]],
        timeout_s: float,
    ) -> np.ndarray:
        n = len(completions)
        rewards = np.zeros((len(fns), n), np.float32)
        flat = rewards.reshape(-1)  # item k: reward k // n on completion k % n
        todo = collections.deque(range(len(fns) * n))
        busy: dict[int, tuple[int, float]] = {}  # Worker slot -> (item, deadline).
        while todo or busy:
            for k, w in enumerate(self._workers):
                if w.ready and k not in busy and todo:
                    i = todo.popleft()
                    j, c = divmod(i, n)
                    try:
                        _write_frame(w.in_fd, (fns[j], i, completions[c], answers[c], fields[c]))
                    except (OSError, ValueError):  # The worker died while idle.
                        todo.appendleft(i)
                        self.stats["crashes"] += 1
                        self._replace(k)
                        continue
                    busy[k] = (i, time.monotonic() + timeout_s)
            waiting = {w.out_fd: k for k, w in enumerate(self._workers) if k in busy or not w.ready}
            deadlines = [d for _, d in busy.values()]
            deadlines += [w.started + self.startup_timeout_s for w in self._workers if not w.ready]
            wait_s = max(0.0, min(deadlines) - time.monotonic())
            readable, _, _ = select.select(list(waiting), [], [], wait_s)
            for fd in readable:
                k = waiting[fd]
                w = self._workers[k]
                try:
                    tag, r, err = _read_frame(fd)
                except (EOFError, OSError, pickle.UnpicklingError):
                    if not w.ready:
                        w.proc.wait()
                        raise RuntimeError(
                            f"reward worker exited during start-up (exit code {w.proc.returncode}); see its stderr."
                        ) from None
                    if k in busy:
                        i, _ = busy.pop(k)
                        log.warning("reward worker crashed on item %d; reward 0.0.", i)
                    self.stats["crashes"] += 1
                    self._replace(k)
                    continue
                if tag == "ready":
                    w.ready = True
                elif tag == "failed":
                    raise RuntimeError(f"reward worker failed to start:\n{err}")
                else:
                    i, _ = busy.pop(k)
                    flat[i] = r
                    self.stats["scored"] += 1
                    if err is not None:
                        self.stats["errors"] += 1
                        log.debug("reward fn raised on item %d: %s", i, err)
            now = time.monotonic()
            for k in [k for k, (_, d) in busy.items() if now > d]:
                i, _ = busy.pop(k)
                flat[i] = 0.0
                self.stats["timeouts"] += 1
                log.warning("reward item %d ran past %.1fs; worker restarted, reward 0.0.", i, timeout_s)
                self._replace(k)
            for w in self._workers:
                if not w.ready and now > w.started + self.startup_timeout_s:
                    raise RuntimeError(f"reward worker not ready after {self.startup_timeout_s:.0f}s.")
        return rewards

    def close(self) -> None:
        """Waits for a running batch, then stops the workers (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._dispatcher.shutdown(wait=True)
        for w in self._workers:
            self._stop_worker(w, kill=not w.ready)

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        # Best effort for pools that are never closed: do not leave workers behind.
        if not getattr(self, "_closed", True):
            for w in getattr(self, "_workers", []):
                if w.proc.poll() is None:
                    w.proc.kill()


def score_batch(
    completions: Sequence[str],
    answers: Sequence[str],
    reward_fn: str | RewardFn = "accuracy",
    *,
    pool: RewardPool | None = None,
    num_workers: int | None = None,
    timeout_s: float | None = None,
) -> np.ndarray:
    """Rewards float32 [len(completions)] for a batch.

    Uses `pool` when given (`timeout_s`, if set, overrides its per-item
    timeout); otherwise starts a temporary `RewardPool` (costs a
    few seconds of worker start-up: training loops should keep one pool).
    """
    if pool is not None:
        return pool.score(completions, answers, reward_fn, timeout_s=timeout_s)
    with RewardPool(num_workers, timeout_s=timeout_s or 10.0) as tmp_pool:
        return tmp_pool.score(completions, answers, reward_fn)
