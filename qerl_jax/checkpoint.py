"""Training checkpoints with orbax: written atomically, resumed exactly.

A checkpoint holds what a run needs to continue bit for bit: the train state (LoRA params,
optimizer state, step), the PRNG key, the prompt loader's position and the config (JSON).
The frozen base model is not saved: it is re-read from the model directory on resume.

Faults: orbax writes each step to a temporary directory and renames it when complete, so a
process killed inside a save leaves the previous steps as they were (the partial directory is
ignored, and replaced by the next save of that step). A save that fails (e.g. the disk is full)
raises `CheckpointWriteError`; `restore_latest` skips unreadable (corrupted) steps for the
newest readable one, says which it skipped and moves them aside (`<step>.unreadable`), so the
run can write those steps again.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp


class CheckpointWriteError(OSError):
    """A checkpoint could not be written; the earlier checkpoints are untouched."""


class CheckpointReadError(RuntimeError):
    """No checkpoint of a directory that holds some could be read."""


@dataclasses.dataclass
class Restored:
    """What `restore_latest` found: the newest readable step and the newer ones it skipped."""

    step: int
    state: Any
    meta: dict[str, Any]
    skipped: list[str]  # "step N: why it could not be read (moved to ...)", newest first


class Checkpointer:
    """Thin wrapper over `ocp.CheckpointManager` for the train state + JSON metadata."""

    def __init__(self, directory: str, *, max_to_keep: int = 3):
        self.directory = os.path.abspath(directory)
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True, enable_async_checkpointing=False)
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(self, step: int, state: Any, meta: dict[str, Any]) -> None:
        """Saves `state` (a pytree of arrays; PRNG keys as raw uint32 data) and JSON `meta`.

        Raises CheckpointWriteError (naming the step, directory and cause) if the save fails.
        """
        threads = set(threading.enumerate())
        try:
            self._manager.save(
                step,
                args=ocp.args.Composite(state=ocp.args.StandardSave(_to_savable(state)), meta=ocp.args.JsonSave(meta)),
                force=True,
            )
            self._manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001 (orbax and tensorstore raise many types; the cause is kept)
            _join_new_threads(threads)
            raise CheckpointWriteError(f"could not write checkpoint step {step} to {self.directory}: {e}") from e

    def restore(self, step: int | None, like: Any) -> tuple[Any, dict[str, Any]]:
        """Restores the state into the structure/dtypes/shardings of `like`, and the metadata."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint to resume from in {self.directory}")
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, _to_savable(like))
        out = self._manager.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore())
        )
        return _from_savable(out["state"], like), out["meta"]

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
            except Exception as e:  # noqa: BLE001 (a damaged checkpoint fails in orbax, tensorstore or json)
                reason = str(e).strip().splitlines()[0] if str(e).strip() else ""
                failures.append((step, f"{type(e).__name__}: {reason[:200]}"))
                continue
            skipped = []
            for bad, why in failures:
                moved = os.path.join(self.directory, f"{bad}.unreadable")
                while os.path.exists(moved):
                    moved += "+"
                os.replace(os.path.join(self.directory, str(bad)), moved)
                skipped.append(f"step {bad}: {why} (moved to {moved})")
            if failures:
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
        if _is_key(ref):
            return jax.random.wrap_key_data(x, impl=jax.random.key_impl(ref))
        return x

    return jax.tree.map(conv, tree, like)
