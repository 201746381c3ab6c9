"""A run over several processes (one per GPU or per host) through `jax.distributed`.

Every process runs the same loop on the same config and data order; process 0 (the primary)
alone holds the workdir lock and writes TensorBoard, samples, evaluations and the PEFT adapter;
orbax checkpoints are written and read by all of them together. Nothing here moves data: XLA's
collectives and `jax.experimental.multihost_utils` do.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator

import jax
import numpy as np
from jax.experimental import multihost_utils

from qerl_jax import sharding, workdir
from qerl_jax.errors import UserFacingError


class SetupError(UserFacingError):
    """A multi-process or mesh setting that cannot work, found before anything is loaded."""

    exit_code = 2


def initialize() -> None:
    """`jax.distributed.initialize` when the environment asks for several processes (see
    `sharding.maybe_initialize_distributed`); a bad setting is one line (exit 2)."""
    try:
        sharding.maybe_initialize_distributed()
    except ValueError as e:
        raise SetupError(f"multi-process settings: {e}") from None
    except RuntimeError as e:  # the coordinator cannot be reached, or the processes never all came
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SetupError(f"multi-process start-up failed: {first}") from None


def run_mesh(data: int, model: int, prompts_per_step: int):
    """The run's ("data", "model") mesh over every process's devices, or None for one device of
    one process; a mesh that cannot be built is one line naming mesh.data / mesh.model."""
    if data * model == 1 and jax.process_count() == 1:
        return None
    from qerl_jax.rollout.data_parallel import local_shards  # noqa: PLC0415 (rollout sits below the runs)

    try:
        mesh = sharding.make_mesh(data, model)
        local_shards(mesh)
    except ValueError as e:
        where = f" over {jax.process_count()} processes" if jax.process_count() > 1 else ""
        raise SetupError(f"config.mesh: {e} ({jax.device_count()} devices{where})") from None
    if prompts_per_step % mesh.shape["data"]:
        raise SetupError(
            f"config.rollout.prompts_per_step = {prompts_per_step} must be a multiple of mesh.data = "
            f"{mesh.shape['data']}: each data shard samples the same number of prompts"
        )
    return mesh


def host_copy(tree):
    """Every array of `tree` as numpy on every process (arrays split over processes are gathered)."""
    if jax.process_count() == 1:
        return jax.device_get(tree)
    return multihost_utils.process_allgather(tree, tiled=True)


def is_primary() -> bool:
    return jax.process_index() == 0


def agree(value: bool) -> bool:
    """The primary's `value`, on every process (one process alone: `value`)."""
    if jax.process_count() == 1:
        return value
    return bool(multihost_utils.broadcast_one_to_all(np.int32(value)))


@contextlib.contextmanager
def primary_lock(path: str) -> Iterator[None]:
    """The workdir lock, held by the primary for the whole run; every process stops with the
    primary's one line if it cannot be had."""
    if jax.process_count() == 1:
        with workdir.lock(path):
            yield
        return
    busy = None
    with contextlib.ExitStack() as stack:
        if is_primary():
            try:
                stack.enter_context(workdir.lock(path))
            except workdir.WorkdirBusyError as e:
                busy = e
        if not agree(busy is None):
            raise SetupError(str(busy) if busy else f"workdir {os.path.abspath(path)} is in use by another run")
        yield


def barrier(name: str) -> None:
    """Waits for every process (no-op for one)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def primary_first(load):
    """`load()` on the primary, then on the others: what it writes (a tiny model, a converted
    GGUF in the shared cache) is written once, and read by the rest."""
    if jax.process_count() == 1:
        return load()
    out = load() if is_primary() else None
    barrier("qerl-primary-loaded")
    return out if is_primary() else load()


# How long process 0 outlives the others once every process is done: it hosts jax's coordination
# service, which the others' runtimes poll until their processes are gone.
LEAVE_GRACE_S = 1.0


def leave() -> None:
    """Ends this process of a multi-process command that succeeded, every process in order (one
    process: returns, and the interpreter ends as usual). Call it last: it does not return.

    Every process waits for the others at a last barrier (a peer lost by then is `stop_if_peer_lost`'s
    one line), flushes its output and exits at once: the other processes first, process 0 after
    LEAVE_GRACE_S, since it hosts the coordination service; the run's files are closed by then
    (checkpoints, TensorBoard, the adapter: `train._finish`). Left to jax's own exit
    (`jax.distributed.shutdown` at interpreter exit), process 0 stops the service once every client
    has reached the shutdown barrier, while the processes' runtimes may still poll it: on GPUs each
    process of a run that had succeeded then logged 6-8 gRPC blocks ("WatchTasksAsync failed ...
    UNAVAILABLE ... Connection refused"). Checked on CPU devices (`tests/test_distributed.py`:
    process 0 ends last, no gRPC line on stderr), where that noise did not show.
    """
    if jax.process_count() == 1:
        return
    try:
        barrier("qerl-leave")
    except jax.errors.JaxRuntimeError as e:
        stop_if_peer_lost(e)
        raise
    sys.stdout.flush()
    sys.stderr.flush()
    if is_primary():
        time.sleep(LEAVE_GRACE_S)
    os._exit(0)


def stop_if_peer_lost(error: Exception) -> None:
    """In a multi-process run, a failed collective means another process died: one line, and this
    process ends at once (exit 2; jax's own shutdown would wait for the lost peer, then abort)."""
    if jax.process_count() == 1:
        return
    first = str(error).strip().splitlines()[0][:300] if str(error).strip() else type(error).__name__
    print(
        f"error: process {jax.process_index()} of {jax.process_count()}: another process of this run stopped ({first}); "
        "the last complete checkpoint is kept: start every process again with --config.resume=True",
        file=sys.stderr,
        flush=True,
    )
    os._exit(2)
