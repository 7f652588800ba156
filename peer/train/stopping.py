"""A stop asked for by a signal (SIGTERM, SIGINT), read by the loops that end at a safe point, and
the bounds that make every stop end.

A flag, not a `threading.Event`: `Event.set` takes a lock, and a signal handler runs on the main
thread between any two bytecodes, possibly while that thread is inside the same lock (in
`Event.wait`, or in a first handler interrupted by a second signal). A `shoal join` that received two
SIGTERMs in a row could hang that way for good. Setting and
reading plain attributes takes no lock.

A stop has a budget (`grace_s`, counted from the first signal): the round in progress ends, is
checkpointed, and the peer serves its last payload until the budget is spent. Waits on the swarm that
would outlast it are abandoned (shoal.peer.swarm.exchange's `Abandoned`, raised where the peer waits).
A second signal spends the budget at once. Whatever the peer's threads and helper processes are doing
(a DHT process that died under the same signal, a daemon that stopped answering), a `Watchdog` ends
the process a few seconds past the budget: checkpoints are written atomically, so the last complete
one survives an exit at any point.
"""

import os
import signal
import threading
import time
from collections.abc import Callable

WATCHDOG_MARGIN_S = 8.0
"""How long past its budget (or a second signal) a stop may take before the watchdog exits the
process: the DHT's shutdown and the summary fit well within it."""


class StopRequest:
    """Set once a stop was asked for; `is_set()` is read after each round. `grace_s`: the stop's budget
    from the first signal (None: unbounded, a stop at the next safe point however long it takes)."""

    __slots__ = ("_at", "_set", "_urgent", "_urgent_at", "grace_s")

    def __init__(self, grace_s: float | None = None) -> None:
        self._set = False
        self._urgent = False
        self._at = self._urgent_at = 0.0
        self.grace_s = grace_s

    def set(self) -> None:
        if not self._set:
            self._at = time.monotonic()  # before the flag: a reader that sees it set sees the time
            self._set = True

    def signalled(self) -> None:
        """A signal's stop: the first asks for a stop at the next safe point, a second for one at once."""
        if self._set:
            self._urgent_at = time.monotonic()
            self._urgent = True
        else:
            self.set()

    def is_set(self) -> bool:
        return self._set

    @property
    def urgent(self) -> bool:
        """A second signal came: nothing more is waited for."""
        return self._urgent

    def since_urgent(self) -> float:
        return time.monotonic() - self._urgent_at if self._urgent else 0.0

    def elapsed(self) -> float:
        return time.monotonic() - self._at if self._set else 0.0

    def remaining(self) -> float | None:
        """Seconds left of the stop's budget: None before a stop (or with no budget), 0 once spent."""
        if not self._set or self.grace_s is None:
            return None
        if self._urgent:
            return 0.0
        return max(0.0, self.grace_s - self.elapsed())

    def spent(self) -> bool:
        """Whether a stop was asked for and its budget is spent: waits are abandoned."""
        return self._urgent or (self._set and self.grace_s is not None and self.elapsed() >= self.grace_s)


def stop_on_signals(*signums: signal.Signals, grace_s: float | None = None) -> StopRequest:
    """A StopRequest set by SIGTERM and SIGINT (and `signums`), from the main thread only: a stop at
    the next safe point (a peer's round end, a bootstrap node's next second); a second signal makes
    it urgent. `grace_s`: its budget (`StopRequest`)."""
    stop = StopRequest(grace_s)

    def handler(_signum: int, _frame) -> None:
        stop.signalled()

    for signum in (signal.SIGTERM, signal.SIGINT, *signums):
        signal.signal(signum, handler)
    return stop


class Watchdog:
    """Ends the process if a stop outlasts its budget by `margin_s` (or a second signal by
    `margin_s / 2`): first `before_exit` (ending helper processes), then a line on stderr and
    `os._exit(code)`. A daemon thread that polls the flag; it never touches a lock the main thread may
    hold (it writes with os.write)."""

    POLL_S = 0.2

    def __init__(
        self,
        stop: StopRequest,
        before_exit: Callable[[], None] | None = None,
        *,
        margin_s: float = WATCHDOG_MARGIN_S,
        code: int = 0,
    ) -> None:
        self.stop, self.before_exit, self.margin_s, self.code = stop, before_exit, margin_s, code
        self._done = False
        self._thread = threading.Thread(target=self._watch, name="shoal-stop-watchdog", daemon=True)
        self._thread.start()

    def cancel(self) -> None:
        """The process ends on its own: the watchdog leaves it alone."""
        self._done = True

    def overdue(self) -> bool:
        stop = self.stop
        if not stop.is_set() or stop.grace_s is None:
            return False
        if stop.urgent:
            return stop.since_urgent() >= self.margin_s / 2
        return stop.elapsed() >= stop.grace_s + self.margin_s

    def _watch(self) -> None:
        while not self._done:
            if self.overdue():
                self._force()
                return
            time.sleep(self.POLL_S)

    def _force(self) -> None:
        if self._done:
            return
        try:
            if self.before_exit is not None:
                self.before_exit()
        finally:
            message = (
                f"stop took longer than its {self.stop.grace_s:g} s budget: exiting now "
                "(the last complete checkpoint is kept)\n"
            )
            try:
                os.write(2, message.encode())
            finally:
                os._exit(self.code)
