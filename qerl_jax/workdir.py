"""A run's workdir: checked to be a writable directory, and held by one process at a time.

`lock(workdir)` takes an exclusive `fcntl.flock` on `<workdir>/.lock`. The kernel releases it when
the process ends, however it ends (a SIGKILL included), so a dead run never blocks the next one,
while a second command on a workdir that a live run holds is refused with one line.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from typing import Iterator

from qerl_jax.errors import UserFacingError

LOCK_FILE = ".lock"


class WorkdirBusyError(UserFacingError):
    """Another live process holds the workdir."""

    exit_code = 2


def workdir_problems(workdir: str) -> list[str]:
    """What stops a run writing to `workdir`: a file in its place, or no write permission."""
    return [f"workdir = {workdir!r}: {p}" for p in output_dir_problems(workdir)]


def output_dir_problems(path: str) -> list[str]:
    """What stops a command creating or writing the directory `path`: a file in its place or above
    it, or an existing directory without write permission (best effort: root writes regardless)."""
    path = os.path.abspath(os.path.expanduser(path))
    existing = path
    while not os.path.exists(existing):  # the nearest existing ancestor is where it would be created
        existing = os.path.dirname(existing)
    if existing != path and not os.path.isdir(existing):
        return [f"{existing} is a file, not a directory"]
    if existing == path and not os.path.isdir(path):
        return ["is a file, not a directory"]
    if not os.access(existing, os.W_OK | os.X_OK):
        return [f"{existing} is not writable"]
    return []


@contextlib.contextmanager
def lock(workdir: str) -> Iterator[None]:
    """Holds `<workdir>/.lock` exclusively while the block runs; WorkdirBusyError if a live process has it."""
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, LOCK_FILE)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
            raise WorkdirBusyError(
                f"workdir {os.path.abspath(workdir)} is in use by another run (pid {holder}); wait for it to end "
                "or pass another --config.workdir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock
