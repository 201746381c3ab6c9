"""Training checkpoints with orbax: written atomically, resumed exactly.

A checkpoint holds what a run needs to continue bit for bit: the train state (LoRA params,
optimizer state, step), the PRNG key, the prompt loader's position and the config (JSON).
The frozen base model is not saved: it is re-read from the model directory on resume.

Faults: orbax writes each step to a temporary directory and renames it when complete, so a
process killed inside a save leaves the previous steps as they were (the partial directory is
ignored, and replaced by the next save of that step). A save that fails (e.g. the disk is full)
raises `CheckpointWriteError`; `restore_latest` skips unreadable (corrupted) steps for the
newest readable one, says which it skipped and moves them aside (`<step>.unreadable`), so the
run can write those steps again. A checkpoint of another shape (a different LoRA rank or target
set) is refused before any array is read (`CheckpointMismatchError`), not taken for a damaged one.

Orbax runs each read and write as asyncio tasks on a loop it closes as soon as the first task
fails; the tasks still in flight then fail again on the closed loop, each printing a traceback.
`_drained_loops` lets them finish first, so a failure is one exception and nothing else.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import threading
import time
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging as absl_logging
from jax.experimental import multihost_utils
from orbax.checkpoint._src import asyncio_utils

from qerl_jax.config import recipe_fields


class CheckpointWriteError(OSError):
    """A checkpoint could not be written; the earlier checkpoints are untouched."""


class CheckpointReadError(RuntimeError):
    """No checkpoint of a directory that holds some could be read."""


class CheckpointMismatchError(ValueError):
    """A readable checkpoint whose arrays have other names or shapes than the state to restore.

    `meta` is the checkpoint's JSON metadata (it holds the config the checkpoint was written with).
    """

    def __init__(self, message: str, meta: dict[str, Any]):
        super().__init__(message)
        self.meta = meta


@dataclasses.dataclass
class Restored:
    """What `restore_latest` found: the newest readable step and the newer ones it skipped."""

    step: int
    state: Any
    meta: dict[str, Any]
    skipped: list[str]  # "step N: why it could not be read (moved to ...)", newest first


def saved_steps(checkpoint_dir: str) -> list[int]:
    """The steps of the finished checkpoints in a run's checkpoint directory (orbax names them by step)."""
    if not os.path.isdir(checkpoint_dir):
        return []
    return sorted(int(n) for n in os.listdir(checkpoint_dir) if n.isdigit())


class Checkpointer:
    """Thin wrapper over `ocp.CheckpointManager` for the train state + JSON metadata."""

    def __init__(self, directory: str, *, max_to_keep: int = 3):
        self.directory = os.path.abspath(directory)
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True, enable_async_checkpointing=False)
        handlers = {"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(self, step: int, state: Any, meta: dict[str, Any]) -> None:
        """Saves `state` (a pytree of arrays; PRNG keys as raw uint32 data) and JSON `meta`.

        Raises CheckpointWriteError (naming the step, directory and cause) if the save fails.
        """
        threads = set(threading.enumerate())
        try:
            with _drained_loops(), _no_orbax_thread_tracebacks():
                args = ocp.args.Composite(state=ocp.args.StandardSave(_to_savable(state)), meta=ocp.args.JsonSave(meta))
                self._manager.save(step, args=args, force=True)
                self._manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001 (orbax and tensorstore raise many types; the cause is kept)
            _join_new_threads(threads)
            raise CheckpointWriteError(f"could not write checkpoint step {step} to {self.directory}: {e}") from e

    def restore(self, step: int | None, like: Any) -> tuple[Any, dict[str, Any]]:
        """Restores the state into the structure/dtypes/shardings of `like` (committed to a device where
        its leaves are, so a jitted program sees the same arguments as for `like`), and the metadata."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint to resume from in {self.directory}")
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, _to_savable(like))
        with _drained_loops():
            self._check_shapes(step, abstract)
            out = self._manager.restore(
                step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore())
            )
        return _from_savable(out["state"], like), out["meta"]

    def _check_shapes(self, step: int, abstract: Any) -> None:
        """CheckpointMismatchError if step's stored arrays differ in name or shape from `abstract`'s.

        Reads only metadata (array names and shapes, and the JSON meta).
        """
        stored = _shapes(self._manager.item_metadata(step)["state"])
        wanted = _shapes(abstract)
        problems = [f"{name}: missing" for name in sorted(wanted.keys() - stored.keys())]
        problems += [f"{name}: not in the state to restore" for name in sorted(stored.keys() - wanted.keys())]
        problems += [
            f"{name}: shape {wanted[name]} vs stored {stored[name]}"
            for name in sorted(wanted.keys() & stored.keys())
            if wanted[name] != stored[name]
        ]
        if problems:
            meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
            more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
            raise CheckpointMismatchError(
                f"checkpoint {os.path.join(self.directory, str(step))} holds other arrays than this run's state: "
                f"{'; '.join(problems[:3])}{more}",
                meta if isinstance(meta, dict) else {},
            )

    def restore_latest(self, like: Any) -> Restored | None:
        """The newest checkpoint that reads back, or None if the directory holds none.

        Unreadable newer steps (truncated or garbled files) are skipped, listed in
        `Restored.skipped` and moved to `<step>.unreadable` (orbax would refuse to write those
        steps again); CheckpointReadError, moving nothing, if no step reads back.
        """
        failures = []
        for step in sorted(self._manager.all_steps(), reverse=True):
            try:
                state, meta = self.restore(step, like)
                if not isinstance(meta, dict) or "step" not in meta:
                    raise ValueError("its metadata has no step")
            except CheckpointMismatchError:
                raise  # readable, but written by a run of another shape: not damaged
            except Exception as e:  # noqa: BLE001 (a damaged checkpoint fails in orbax, tensorstore or json)
                reason = str(e).strip().splitlines()[0] if str(e).strip() else ""
                failures.append((step, f"{type(e).__name__}: {reason[:200]}"))
                continue
            skipped = []
            for bad, why in failures if jax.process_index() == 0 else ():  # one process moves them
                moved = os.path.join(self.directory, f"{bad}.unreadable")
                while os.path.exists(moved):
                    moved += "+"
                os.replace(os.path.join(self.directory, str(bad)), moved)
                skipped.append(f"step {bad}: {why} (moved to {moved})")
            if failures:
                if jax.process_count() > 1:
                    multihost_utils.sync_global_devices("qerl-unreadable-checkpoints-moved")
                self._manager.reload()
            return Restored(step=step, state=state, meta=meta, skipped=skipped)
        if failures:
            why = "; ".join(f"step {step}: {why}" for step, why in failures)
            raise CheckpointReadError(f"no checkpoint in {self.directory} can be read ({why})")
        return None

    def read_meta(self, step: int) -> dict[str, Any]:
        """The JSON metadata of a step alone (e.g. the run's config, to build the state's structure)."""
        return self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

    def close(self) -> None:
        self._manager.close()


@contextlib.contextmanager
def _drained_loops():
    """Within it, orbax's synchronous calls let every task of their event loop end before closing it.

    Orbax runs a save or restore with `loop.run_until_complete(gather(...))` and closes the loop
    when the first task fails; TensorStore then completes the other reads or writes on the closed
    loop, each printing "RuntimeError: Event loop is closed", and their coroutines print again when
    collected, or, when one failed before anything awaited it, "Task exception was never retrieved".
    Waiting for those tasks and retrieving every task's exception (dropped: the first failure is
    raised) makes a failed save or restore one exception.

    The hook is private to orbax: on a version without it nothing is patched (a failure may then
    print more, but saves and restores work the same).
    """
    original = getattr(asyncio_utils, "_run_sync_via_new_loop", None)
    if original is None:
        yield
        return

    def run_and_drain(coro):
        loop = asyncio.new_event_loop()
        tasks = []

        def recording_factory(loop, coro, **kwargs):
            task = asyncio.Task(coro, loop=loop, **kwargs)
            tasks.append(task)
            return task

        loop.set_task_factory(recording_factory)
        try:
            asyncio.set_event_loop(loop)
            return loop.run_until_complete(coro)
        finally:
            pending = asyncio.all_tasks(loop)
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            # A task that failed after the first failure, with nothing left awaiting it, would print
            # "Task exception was never retrieved" when collected (seen under load): retrieved here.
            for task in tasks:
                if task.done() and not task.cancelled():
                    task.exception()
            asyncio.set_event_loop(None)
            loop.close()

    asyncio_utils._run_sync_via_new_loop = run_and_drain
    try:
        yield
    finally:
        asyncio_utils._run_sync_via_new_loop = original


class _OrbaxThreadFailure(logging.Filter):
    """Drops orbax's log of an exception in one of its save threads: the save re-raises it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not ("orbax" in record.pathname and "raised an exception" in str(record.msg))


@contextlib.contextmanager
def _no_orbax_thread_tracebacks():
    logger, quiet = absl_logging.get_absl_logger(), _OrbaxThreadFailure()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


def _shapes(tree: Any) -> dict[str, tuple[int, ...]]:
    """{"lora.layers.q_proj.a": shape, ...} of a pytree of arrays or array metadata."""

    def name(key) -> str:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                return str(getattr(key, attr))
        return str(key)

    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {".".join(name(k) for k in path): tuple(leaf.shape) for path, leaf in leaves}


LORA_SHAPE_FIELDS = ("lora.rank", "lora.targets")

# Fields that change what a run means: a resumed run whose config differs from its checkpoint's in one
# of them is refused unless the config's `resume_changes` names it (`resume_problems`). Each is declared
# with recipe=True in `qerl_jax.config`.
RECIPE_FIELDS = recipe_fields()


def config_differences(cfg: Any, saved: Any, fields: tuple[str, ...]) -> list[tuple[str, Any, Any]]:
    """(field, value in `cfg`, value in `saved`) of each of `fields` whose values differ; `cfg` and
    `saved` are nested mappings (a checkpoint's JSON config); a field either lacks is skipped."""
    out = []
    for field in fields:
        here, there = cfg, saved
        for part in field.split("."):
            here = here.get(part) if hasattr(here, "get") else None
            there = there.get(part) if isinstance(there, dict) else None
        if there is None or here is None:
            continue
        norm = lambda v: list(v) if isinstance(v, (list, tuple)) else v  # noqa: E731 (JSON keeps tuples as lists)
        if norm(here) != norm(there):
            out.append((field, here, there))
    return out


def mismatch_message(error: CheckpointMismatchError, cfg: Any, fields: tuple[str, ...] = LORA_SHAPE_FIELDS) -> str:
    """`error` as the config fields that differ from those the checkpoint was written with.

    "lora.rank 16 differs from the checkpoint's 8 (<dir>)"; the array shapes if no field differs.
    """
    saved = error.meta.get("config") if isinstance(error.meta, dict) else None
    differences = [
        f"{field} {_show(here)} differs from the checkpoint's {_show(there)}"
        for field, here, there in config_differences(cfg, saved, fields)
    ]
    if not differences:
        return str(error)
    where = str(error).split(" holds ", 1)[0].removeprefix("checkpoint ")
    return f"{'; '.join(differences)} ({where})"


def resume_problems(cfg: Any, saved: Any, step: int, where: str) -> tuple[list[str], list[str]]:
    """(problems, notes) of resuming the checkpoint of `step` (in `where`, written with config `saved`)
    with config `cfg` (nested mappings; `cfg["resume_changes"]` the comma-separated recipe fields it
    may change). Problems, all of them at once: RECIPE_FIELDS that differ and are not named, one line
    listing them; train.total_steps below the step; LoRA shapes (LORA_SHAPE_FIELDS) that differ, which
    no resume can change (the adapter's arrays would not fit). Notes (to log): each named change;
    total_steps at the step."""
    allowed = {name.strip() for name in str(cfg.get("resume_changes") or "").split(",") if name.strip()}
    changed = config_differences(cfg, saved, RECIPE_FIELDS)
    total = cfg.get("train", {}).get("total_steps")
    below = isinstance(total, int) and total < step  # refused whatever resume_changes says
    refused = [(f, h, t) for f, h, t in changed if f not in allowed and not (below and f == "train.total_steps")]
    problems, notes = [], []
    if refused:
        listed = ", ".join(f"{f} {_show(here)} (checkpoint: {_show(there)})" for f, here, there in refused)
        problems.append(
            f"resume: {listed} {'differ' if len(refused) > 1 else 'differs'} from the checkpoint of step {step} ({where}); they change what the run "
            "means (its batch, schedules, loss, rewards or noise): keep the checkpoint's values, or pass "
            f"--config.resume_changes={','.join(f for f, _, _ in refused)} to change them"
        )
    notes += [f"{f} changed from the checkpoint's {_show(there)} to {_show(here)}" for f, here, there in changed]
    if below:
        problems.append(
            f"train.total_steps = {total}: below the checkpoint's step {step} ({where}), so the run is past its "
            "end already; raise train.total_steps"
        )
    elif total == step and any(f == "train.total_steps" for f, _, _ in changed):
        notes.append(f"train.total_steps = {total} is the checkpoint's step: nothing is left to train")
    shapes = config_differences(cfg, saved, LORA_SHAPE_FIELDS)
    if shapes:
        listed = "; ".join(
            f"{f} {_show(here)} differs from the checkpoint's {_show(there)}" for f, here, there in shapes
        )
        problems.append(
            f"cannot resume: {listed} ({where}); the adapter's shapes follow them: keep the checkpoint's values, "
            "or start a new run in another workdir"
        )
    return problems, notes


def latest_meta(checkpoint_dir: str) -> tuple[int, dict[str, Any]] | None:
    """(step, JSON metadata) of the newest checkpoint whose metadata reads, or None (reads no arrays)."""
    steps = saved_steps(checkpoint_dir)
    if not steps:
        return None
    ckpt = Checkpointer(checkpoint_dir)
    try:
        for step in reversed(steps):
            try:
                meta = ckpt.read_meta(step)
            except Exception:  # noqa: BLE001 (a damaged checkpoint: the resume skips it too)
                continue
            if isinstance(meta, dict):
                return step, meta
    finally:
        ckpt.close()
    return None


def _show(value: Any) -> str:
    return ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


def _join_new_threads(before: set[threading.Thread], timeout_s: float = 60.0) -> None:
    """Waits for the threads a failed save started (orbax's commit threads) to end, so that they
    do not fail again, noisily, while the interpreter shuts down."""
    deadline = time.monotonic() + timeout_s
    for t in set(threading.enumerate()) - before:
        # is_alive() is False for a thread not started yet (join() would raise): nothing to wait for.
        if t is not threading.current_thread() and t.is_alive():
            t.join(max(0.0, deadline - time.monotonic()))


def _is_key(x) -> bool:
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _to_savable(tree: Any) -> Any:
    """Typed PRNG keys -> their uint32 key data; Python scalars -> numpy (orbax saves arrays)."""

    def conv(x):
        if _is_key(x):
            return jax.random.key_data(x)
        if isinstance(x, (int, float)):
            return np.asarray(x)
        return x

    return jax.tree.map(conv, tree)


def _from_savable(tree: Any, like: Any) -> Any:
    def conv(x, ref):
        if isinstance(ref, jax.Array) and not ref.committed and isinstance(x, jax.Array) and x.committed:
            # orbax returns arrays committed to their device, a fresh state's are not, and jit writes a
            # committed argument's sharding into the program: a resumed run's programs would all miss
            # the persistent cache its fresh start filled (an NVFP4 1.5B rollout compiles for ~50 s).
            x = jax.numpy.asarray(np.asarray(x))
        if _is_key(ref):
            return jax.random.wrap_key_data(x, impl=jax.random.key_impl(ref))
        return x

    return jax.tree.map(conv, tree, like)
