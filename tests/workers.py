"""Runs N loopback workers of one test on threads, each with its LoopbackExchange."""

import threading
from collections.abc import Callable
from datetime import timedelta

from shoal.peer.exchange import LoopbackExchange


def run_workers(count: int, work: Callable[[int, LoopbackExchange], object], timeout_s: float = 120) -> list:
    """Calls work(rank, exchange) on `count` threads; returns the results in rank order.

    A worker that raises aborts the others' barrier, and its exception is raised here.
    """
    exchanges = LoopbackExchange.group(count, timeout=timedelta(seconds=timeout_s))
    results: list = [None] * count
    errors: list[BaseException] = []

    def target(rank: int) -> None:
        try:
            results[rank] = work(rank, exchanges[rank])
        except BaseException as error:
            errors.append(error)
            exchanges[rank].abort()

    threads = [threading.Thread(target=target, args=(rank,), daemon=True) for rank in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s)
    if errors:
        raise errors[0]
    if any(thread.is_alive() for thread in threads):
        raise TimeoutError(f"workers still running after {timeout_s} s")
    return results
