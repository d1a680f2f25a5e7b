"""Ctrl-C ends the CLI's endless loops (``board --watch``, ``logs -f``) even when Python drops the
KeyboardInterrupt (daemon/cli/human/interrupt.py)."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from daemon.cli.human.interrupt import UntilInterrupted


def test_a_sigint_ends_the_loop_and_is_absorbed_and_the_handler_comes_back() -> None:
    before = signal.getsignal(signal.SIGINT)
    turns = 0
    with UntilInterrupted() as stop:
        while not stop.requested:
            turns += 1
            if turns == 3:
                os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.01)
        pytest.fail("the KeyboardInterrupt should have left the loop")  # pragma: no cover
    assert stop.requested and turns == 3
    assert signal.getsignal(signal.SIGINT) is before


class _Finalized:
    """An object whose finalizer is running when the SIGINT is handled."""

    def __del__(self) -> None:
        os.kill(os.getpid(), signal.SIGINT)
        sum(range(1000))  # Python runs the handler here: its KeyboardInterrupt is "ignored" and dropped


def test_a_sigint_python_drops_in_a_finalizer_still_ends_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    dropped: list[type[BaseException] | None] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: dropped.append(u.exc_type))
    turns = 0
    with UntilInterrupted() as stop:
        while not stop.requested:
            turns += 1
            assert turns < 100, "the loop never saw the Ctrl-C"
            if turns == 2:
                _Finalized()  # freed at once: the interrupt is lost inside __del__
            time.sleep(0.001)
    assert stop.requested and turns == 2
    assert dropped == [KeyboardInterrupt]  # Python dropped it: only the flag ended the loop


def test_a_process_started_with_sigint_ignored_keeps_ignoring_it() -> None:
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with UntilInterrupted() as stop:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.01)
        assert not stop.requested
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


def test_other_errors_pass_through() -> None:
    with pytest.raises(ValueError), UntilInterrupted():
        raise ValueError("not ours to absorb")
