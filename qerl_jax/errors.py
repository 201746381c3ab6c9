"""Errors shared by the library's modules and commands."""

from __future__ import annotations


class UserFacingError(RuntimeError):
    """A problem the user can fix (bad path, out of memory, ...): printed without a traceback."""

    exit_code = 1  # the commands' exit status for it
