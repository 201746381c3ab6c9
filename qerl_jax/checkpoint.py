"""Training checkpoints with orbax: written atomically, resumed exactly.

A checkpoint holds what a run needs to continue bit for bit: the train state (LoRA params,
optimizer state, step), the PRNG key, the prompt loader's position and the config (JSON).
The frozen base model is not saved: it is re-read from the model directory on resume.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp


class Checkpointer:
    """Thin wrapper over `ocp.CheckpointManager` for the train state + JSON metadata."""

    def __init__(self, directory: str, *, max_to_keep: int = 3):
        self.directory = os.path.abspath(directory)
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True, enable_async_checkpointing=False)
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(self, step: int, state: Any, meta: dict[str, Any]) -> None:
        """Saves `state` (a pytree of arrays; PRNG keys as raw uint32 data) and JSON `meta`."""
        self._manager.save(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardSave(_to_savable(state)), meta=ocp.args.JsonSave(meta)),
            force=True,
        )
        self._manager.wait_until_finished()

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

    def close(self) -> None:
        self._manager.close()


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
