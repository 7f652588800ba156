"""One exchange in flight on a thread of its own: how an overlapped optimizer (DeMo with overlap,
DiLoCo's delayed and eager modes) computes the next round while the last one is exchanged."""

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

T = TypeVar("T")


class InFlight(Generic[T]):
    """At most one call in flight, on one background thread named `name`."""

    def __init__(self, name: str):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._pending: Future[T] | None = None

    @property
    def busy(self) -> bool:
        return self._pending is not None

    def start(self, call: Callable[..., T], *args) -> None:
        """Runs `call(*args)` in the background; the one before must have been waited for."""
        if self._pending is not None:
            raise RuntimeError("a call is still in flight: wait() for it first")
        self._pending = self._pool.submit(call, *args)

    def wait(self) -> T | None:
        """The result of the call in flight (raising what it raised), None if there is none."""
        if self._pending is None:
            return None
        pending, self._pending = self._pending, None
        return pending.result()

    def peek(self) -> T | None:
        """The result of the call in flight, waited for and left in flight (None if there is none)."""
        return None if self._pending is None else self._pending.result()

    def close(self, *, raise_error: bool = True) -> None:
        """Waits for the call in flight (collectives must complete on every participant), raising
        what it raised unless `raise_error` is False, and stops the thread."""
        try:
            if self._pending is not None:
                pending, self._pending = self._pending, None
                if raise_error:
                    pending.result()
                else:
                    pending.exception()
        finally:
            self._pool.shutdown(wait=True)
