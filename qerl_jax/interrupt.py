"""Ctrl-C that is never lost: the handler records the request besides raising KeyboardInterrupt.

Native code that checks for signals while it runs (a compile, a device wait) can swallow the
KeyboardInterrupt, and the run would go on. Long loops call `check()` between steps, so a Ctrl-C
stops them at the latest at the end of the step it came in.
"""

from __future__ import annotations

import signal
import threading

_requested = threading.Event()


def _on_sigint(signum, frame) -> None:
    _requested.set()
    raise KeyboardInterrupt


def install() -> None:
    """Installs the handler in the main thread, unless SIGINT is not Python's default (ignored, or
    a handler of the caller's)."""
    if (
        threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    ):
        signal.signal(signal.SIGINT, _on_sigint)


def check() -> None:
    """Raises KeyboardInterrupt if a Ctrl-C came since `install` (even if it was swallowed)."""
    if _requested.is_set():
        raise KeyboardInterrupt
