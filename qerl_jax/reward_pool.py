"""A process pool that scores (completion, answer) batches with a per-item deadline.

Parsing and comparing answers can be slow on pathological strings, so batches
are scored in worker processes (`RewardPool`): a worker that runs past an
item's deadline is killed and replaced, and the item scores 0.0. The deadline
counts scoring time only: a worker's start-up and the import of a reward's
module (on its first item, when the reward function is unpickled) are bounded
by `startup_timeout_s` instead, so a loaded machine does not turn a slow
import into timeouts. Inside a worker the reward runs in the main thread,
where math-verify's own signal-based timeouts work as well.

Workers are plain `python -c` subprocesses speaking length-prefixed pickle
frames over stdin/stdout. Unlike multiprocessing's spawn/forkserver, this
never re-imports the caller's __main__ (works from unguarded scripts and
notebooks), and unlike fork it is safe in a process running JAX threads.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import math
import os
import pickle
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from typing import Any, Sequence

import numpy as np

from qerl_jax.rewards import RewardFn, accuracy_reward, call_reward, get_reward_fn

log = logging.getLogger(__name__)


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
    """Worker entry point: frames (idx, pickled (fn, completion, answer, fields)) -> ("started", idx, None)
    once the item is unpickled (the reward's module imported), then (idx, reward, err)."""
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
        idx, payload = msg
        try:
            fn, completion, answer, fields = pickle.loads(payload)  # imports the reward's module
        except Exception as e:  # noqa: BLE001 (the item fails, the worker goes on)
            _write_frame(out_fd, (idx, 0.0, f"cannot load the reward in a worker: {type(e).__name__}: {e}"[:500]))
            continue
        _write_frame(out_fd, ("started", idx, None))  # the item's deadline starts now
        err, r = None, 0.0
        try:
            r = float(call_reward(fn, completion, answer, fields))
            if not math.isfinite(r):
                err, r = f"non-finite reward {r}", 0.0
        except BaseException as e:  # Includes math-verify's TimeoutException.
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            err, r = f"{type(e).__name__}: {e}"[:500], 0.0
        _write_frame(out_fd, (idx, r, err))


_WORKER_CMD = "from qerl_jax.reward_pool import _worker_loop; _worker_loop()"


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


def reward_name(reward_fn: str | RewardFn) -> str:
    """How a reward is named in `RewardPool.reward_stats`: its spec string, or "module:function"."""
    if isinstance(reward_fn, str):
        return reward_fn
    return f"{getattr(reward_fn, '__module__', '?')}:{getattr(reward_fn, '__qualname__', repr(reward_fn))}"


def _default_num_workers() -> int:
    return max(1, min(8, (os.cpu_count() or 2) // 2))


@dataclasses.dataclass(eq=False)
class _Batch:
    """A submitted batch: item i is reward i // n on completion i % n; resolved when `left` reaches 0."""

    fns: list[RewardFn]
    names: list[str]
    completions: list[str]
    answers: list[str]
    fields: list[dict[str, Any]]
    timeout_s: float
    squeeze: bool
    future: concurrent.futures.Future = dataclasses.field(default_factory=concurrent.futures.Future)

    def __post_init__(self) -> None:
        self.future.set_running_or_notify_cancel()  # its items are queued: it cannot be cancelled
        self.rewards = np.zeros((len(self.fns), len(self.completions)), np.float32)
        self.left = self.rewards.size

    def payload(self, i: int) -> bytes:
        j, c = divmod(i, len(self.completions))
        item = (self.fns[j], self.completions[c], self.answers[c], self.fields[c])
        return pickle.dumps(item, protocol=pickle.HIGHEST_PROTOCOL)

    def name(self, i: int) -> str:
        return self.names[i // len(self.completions)]

    def store(self, i: int, reward: float) -> None:
        """Stores item i's reward; the last item resolves the future."""
        self.rewards.reshape(-1)[i] = reward
        self.left -= 1
        if self.left == 0:
            self.resolve()

    def resolve(self) -> None:
        self.future.set_result(self.rewards[0] if self.squeeze else self.rewards)


@dataclasses.dataclass
class _Job:
    """An item on a worker: until the worker says it started the item (its reward unpickled, the
    module imported), the deadline is the start-up one."""

    batch: _Batch
    i: int
    deadline: float
    scoring: bool = False


class RewardPool:
    """Scores (completion, answer) batches in worker processes with a per-item timeout.

    Workers are started once and reused; a worker exceeding `timeout_s` on an
    item is killed and replaced, and that item scores 0.0 (counted in
    `stats["timeouts"]`). `submit` returns a future at once: a background thread
    hands the items of all submitted batches to idle workers in submission order
    (one queue of items), and resolves each batch's future when its own items are
    scored, so a slow item costs its own deadline, not a wait for later batches.
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
        # Per reward (its name as given, or "module:function"): items and failed (raised, non-finite,
        # timed out, worker died) so far, and the first failure's text (`reward_guard` reads them).
        self.reward_stats: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.first_errors: dict[str, str] = {}
        self._env = _worker_env()
        self._lock = threading.Lock()  # guards _closed, _todo and _scheduler
        self._closed = False
        self._todo: collections.deque[tuple[_Batch, int]] = collections.deque()  # items not yet on a worker
        self._scheduler: threading.Thread | None = None  # runs while items are queued or being scored
        # A new batch wakes the scheduler from its wait on the workers' pipes.
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._workers = [self._start_worker() for _ in range(num_workers)]

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
        names = [reward_name(f) for f in reward_fns]
        batch = _Batch(fns, names, completions, answers, fields, timeout_s, _squeeze)
        self._enqueue(batch)
        return batch.future

    def _enqueue(self, batch: _Batch) -> None:
        """Queues a batch's items behind those already submitted; starts the scheduler if none runs."""
        with self._lock:
            if self._closed:
                raise RuntimeError("RewardPool is closed.")
            self._todo.extend((batch, i) for i in range(batch.left))
            if batch.left and self._scheduler is None:
                self._scheduler = threading.Thread(target=self._schedule, name="reward-pool")
                self._scheduler.start()
            elif batch.left:
                try:
                    os.write(self._wake_w, b"x")
                except BlockingIOError:  # The pipe is full of wake-ups already.
                    pass
        if not batch.left:
            batch.resolve()

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

    def _schedule(self) -> None:
        """The scheduler thread: hands queued items to idle workers and collects their results until no
        item is queued or being scored. A worker failing to start fails every batch not yet resolved."""
        busy: dict[int, _Job] = {}  # worker slot -> its item
        try:
            while True:
                with self._lock:
                    if not self._todo and not busy:
                        self._scheduler = None
                        return
                self._dispatch(busy)
                for k, tag, r, err in self._receive(busy):
                    self._take_frame(busy, k, tag, r, err)
                self._expire(busy)
        except Exception as e:  # noqa: BLE001 (the batches' futures carry it)
            self._fail_pending(busy, e)

    def _dispatch(self, busy: dict[int, _Job]) -> None:
        """Sends the next queued items to the idle, ready workers."""
        for k, w in enumerate(self._workers):
            if not w.ready or k in busy:
                continue
            with self._lock:
                if not self._todo:
                    return
                batch, i = self._todo.popleft()
            try:
                _write_frame(w.in_fd, (i, batch.payload(i)))
            except (OSError, ValueError):  # The worker died while idle.
                with self._lock:
                    self._todo.appendleft((batch, i))
                self.stats["crashes"] += 1
                self._replace(k)
                continue
            busy[k] = _Job(batch, i, time.monotonic() + self.startup_timeout_s)

    def _take_frame(self, busy: dict[int, _Job], k: int, tag: str | None, r: Any, err: str | None) -> None:
        """Acts on what `_receive` read from worker slot k."""
        if tag == "started":
            busy[k].deadline = time.monotonic() + busy[k].batch.timeout_s
            busy[k].scoring = True
            return
        job = busy.pop(k)
        if tag == "crashed":
            log.warning("reward worker crashed on item %d; reward 0.0.", job.i)
            self._record(job.batch.name(job.i), f"its worker process died (exit code {r})")
        else:
            self.stats["scored"] += 1
            self._record(job.batch.name(job.i), err)
            if err is not None:
                self.stats["errors"] += 1
                log.debug("reward fn raised on item %d: %s", job.i, err)
        job.batch.store(job.i, 0.0 if tag == "crashed" else r)

    def _expire(self, busy: dict[int, _Job]) -> None:
        """Items past their deadline score 0.0 and their workers are replaced; raises if a worker is not
        ready within the start-up deadline."""
        now = time.monotonic()
        for k in [k for k, job in busy.items() if now > job.deadline]:
            job = busy.pop(k)
            self.stats["timeouts"] += 1
            why = f"ran past {job.batch.timeout_s:g} s"
            if not job.scoring:
                why = f"was not loaded in a worker within {self.startup_timeout_s:g} s"
            log.warning("reward item %d %s; worker restarted, reward 0.0.", job.i, why)
            self._record(job.batch.name(job.i), f"timed out: {why}")
            self._replace(k)
            job.batch.store(job.i, 0.0)
        for w in self._workers:
            if not w.ready and now > w.started + self.startup_timeout_s:
                raise RuntimeError(f"reward worker not ready after {self.startup_timeout_s:.0f}s.")

    def _fail_pending(self, busy: dict[int, _Job], error: BaseException) -> None:
        """Fails the future of every batch with an item queued or on a worker (their workers are
        replaced: a late result must not be read as a later item's); a later batch tries again."""
        with self._lock:
            pending = [batch for batch, _ in self._todo]
            self._todo.clear()
            self._scheduler = None
        for k, job in busy.items():
            pending.append(job.batch)
            self._replace(k)
        for batch in dict.fromkeys(pending):
            if not batch.future.done():
                batch.future.set_exception(error)

    def _receive(self, busy: dict[int, _Job]) -> list[tuple[int, str | None, Any, str | None]]:
        """(slot, tag, reward or exit code, error) of the frames that arrive before the nearest deadline
        or a new batch: tag "started" (an item's scoring began), None (a result), "crashed" (the busy
        worker died)."""
        waiting = {w.out_fd: k for k, w in enumerate(self._workers) if k in busy or not w.ready}
        deadlines = [job.deadline for job in busy.values()]
        deadlines += [w.started + self.startup_timeout_s for w in self._workers if not w.ready]
        wait_s = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
        readable, _, _ = select.select([*waiting, self._wake_r], [], [], wait_s)
        if self._wake_r in readable:  # New items: the caller dispatches them.
            readable.remove(self._wake_r)
            os.read(self._wake_r, 4096)  # Any wake-ups left make the next wait return at once.
        out = []
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
                self.stats["crashes"] += 1
                self._replace(k)  # kills and reaps it: its exit code is known after
                if k in busy:
                    out.append((k, "crashed", w.proc.returncode, None))
                continue
            if tag == "ready":
                w.ready = True
            elif tag == "failed":
                raise RuntimeError(f"reward worker failed to start:\n{err}")
            elif tag == "started":
                out.append((k, "started", r, None))
            else:
                out.append((k, None, r, err))
        return out

    def _record(self, name: str, error: str | None) -> None:
        """Counts a scored item of reward `name` (`reward_stats`), failed when `error`; keeps its first error."""
        counts = self.reward_stats[name]
        counts["items"] += 1
        if error is not None:
            counts["failed"] += 1
            self.first_errors.setdefault(name, error)

    def close(self) -> None:
        """Waits for every submitted batch, then stops the workers (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            scheduler = self._scheduler
        if scheduler is not None:
            scheduler.join()
        for w in self._workers:
            self._stop_worker(w, kill=not w.ready)
        os.close(self._wake_r)
        os.close(self._wake_w)

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
            for fd in (getattr(self, "_wake_r", None), getattr(self, "_wake_w", None)):
                if fd is not None:
                    os.close(fd)


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
