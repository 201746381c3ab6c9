"""qerl_jax.interrupt: a Ctrl-C that native code swallows is still acted on at the next check."""

import signal

import pytest

from qerl_jax import interrupt


def test_a_swallowed_ctrl_c_is_raised_at_the_next_check(monkeypatch):
    monkeypatch.setattr(interrupt, "_requested", type(interrupt._requested)())
    previous = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        interrupt.install()
        assert signal.getsignal(signal.SIGINT) is interrupt._on_sigint
        interrupt.check()  # nothing came yet
        try:
            signal.raise_signal(signal.SIGINT)
        except KeyboardInterrupt:
            pass  # what a native call that checks signals might swallow
        with pytest.raises(KeyboardInterrupt):
            interrupt.check()
    finally:
        signal.signal(signal.SIGINT, previous)


def test_an_ignored_sigint_stays_ignored():
    previous = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # e.g. a run under nohup
    try:
        interrupt.install()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)
