"""Ctrl-C for the CLI's loops that run until the user stops them (``board --watch``, ``logs -f``).

Python turns SIGINT into ``KeyboardInterrupt`` wherever the main thread happens to be. When that
is inside a finalizer (an object's ``__del__``, a generator being closed, a weakref callback), the
exception is reported as "Exception ignored" and dropped, and a loop that relied on it alone would
go on forever. ``UntilInterrupted`` also records the request: the loop checks it at each turn, so a
Ctrl-C always ends the command, at the latest one turn later.
"""

from __future__ import annotations

import signal

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (a CLI module)
if TYPE_CHECKING:
    from types import FrameType, TracebackType


class UntilInterrupted:
    """``with UntilInterrupted() as stop: while not stop.requested: ...``

    A SIGINT sets ``requested`` and raises ``KeyboardInterrupt`` (which cuts a sleep or a read
    short); the ``with`` absorbs it. The previous handler is put back at the end. A process that
    was started with SIGINT ignored (a background job of a script) keeps ignoring it."""

    __slots__ = ("requested", "_previous")

    def __init__(self) -> None:
        self.requested = False
        self._previous: object = None

    def _on_sigint(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True
        raise KeyboardInterrupt

    def __enter__(self) -> UntilInterrupted:
        self._previous = signal.getsignal(signal.SIGINT)
        if self._previous is not signal.SIG_IGN:
            signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool:
        if self._previous is not signal.SIG_IGN:
            signal.signal(signal.SIGINT, self._previous)  # type: ignore[arg-type]
        return kind is KeyboardInterrupt
