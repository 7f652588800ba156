"""A stop asked for by a signal (SIGTERM, SIGINT), read by the loops that end at a safe point.

A flag, not a `threading.Event`: `Event.set` takes a lock, and a signal handler runs on the main
thread between any two bytecodes, possibly while that thread is inside the same lock (in
`Event.wait`, or in a first handler interrupted by a second signal). A `shoal join` that received two
SIGTERMs in a row hung that way for good (issue 47: a demo killed with SIGKILL left one). Setting and
reading a plain attribute takes no lock.
"""

import signal


class StopRequest:
    """Set once a stop was asked for; `is_set()` is read after each round."""

    __slots__ = ("_set",)

    def __init__(self) -> None:
        self._set = False

    def set(self) -> None:
        self._set = True

    def is_set(self) -> bool:
        return self._set


def stop_on_signals(*signums: signal.Signals) -> StopRequest:
    """A StopRequest set by SIGTERM and SIGINT (and `signums`), from the main thread only: a stop at
    the next safe point (a peer's round end, a bootstrap node's next second)."""
    stop = StopRequest()

    def handler(_signum: int, _frame) -> None:
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT, *signums):
        signal.signal(signum, handler)
    return stop
