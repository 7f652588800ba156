"""How pulls are paced: InFlight's admission (shoal.peer.swarm.pull) and the order a coordinated
round pulls in (shoal.peer.swarm.coordinated.pull_order)."""

import asyncio
import dataclasses
import time

import pytest

from shoal.peer.swarm.coordinated import pull_order
from shoal.peer.swarm.pull import CANCEL_GRACE_S, InFlight, abandon
from shoal.peer.swarm.records import Announcement

pytestmark = pytest.mark.timeout(30)


async def _pull(budget: InFlight, name: str, size: int, log: list, release: asyncio.Event) -> None:
    async with budget.hold(size):
        log.append(("start", name, budget.pulls, budget.bytes))
        await release.wait()
    log.append(("end", name))


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_small_pulls_run_side_by_side_up_to_the_count():
    async def main():
        budget, log, release = InFlight(max_pulls=3, max_bytes=1000), [], asyncio.Event()
        tasks = [asyncio.create_task(_pull(budget, f"p{i}", 10, log, release)) for i in range(5)]
        await _settle()
        assert [entry[1] for entry in log] == ["p0", "p1", "p2"] and budget.pulls == 3
        release.set()
        await asyncio.gather(*tasks)
        assert budget.pulls == 0 and budget.bytes == 0
        assert [entry[1] for entry in log if entry[0] == "start"] == ["p0", "p1", "p2", "p3", "p4"]

    asyncio.run(main())


def test_large_pulls_run_one_at_a_time_in_the_order_asked():
    async def main():
        budget, log = InFlight(max_pulls=4, max_bytes=1000), []
        releases = [asyncio.Event() for _ in range(3)]
        tasks = [asyncio.create_task(_pull(budget, f"p{i}", 800, log, releases[i])) for i in range(3)]
        for i in range(3):
            await _settle()
            assert [entry[1] for entry in log if entry[0] == "start"] == [f"p{j}" for j in range(i + 1)]
            assert budget.pulls == 1 and budget.bytes == 800
            releases[i].set()
        await asyncio.gather(*tasks)
        assert budget.pulls == 0 and budget.bytes == 0

    asyncio.run(main())


def test_a_pull_larger_than_the_budget_still_runs_alone():
    async def main():
        budget, log, release = InFlight(max_pulls=4, max_bytes=100), [], asyncio.Event()
        tasks = [asyncio.create_task(_pull(budget, f"p{i}", 10_000, log, release)) for i in range(2)]
        await _settle()
        assert log == [("start", "p0", 1, 10_000)]
        release.set()
        await asyncio.gather(*tasks)
        assert log[-1] == ("end", "p1")

    asyncio.run(main())


def test_a_cancelled_waiter_lets_the_next_one_in_and_leaks_nothing():
    async def main():
        budget, log = InFlight(max_pulls=4, max_bytes=1000), []
        first, never = asyncio.Event(), asyncio.Event()
        running = asyncio.create_task(_pull(budget, "big", 900, log, first))
        await _settle()
        blocked = asyncio.create_task(_pull(budget, "blocked", 900, log, never))
        small = asyncio.create_task(_pull(budget, "small", 50, log, first))
        await _settle()
        # "small" would fit beside "big", but waits behind "blocked": admission keeps the order
        assert [entry[1] for entry in log] == ["big"]
        blocked.cancel()
        await _settle()
        assert [entry[1] for entry in log] == ["big", "small"] and budget.bytes == 950
        first.set()
        await asyncio.gather(running, small)
        with pytest.raises(asyncio.CancelledError):
            await blocked
        assert budget.pulls == 0 and budget.bytes == 0

    asyncio.run(main())


def test_a_pull_that_fails_gives_its_place_back():
    async def main():
        budget = InFlight(max_pulls=1, max_bytes=0)
        with pytest.raises(ConnectionError):
            async with budget.hold(5):
                raise ConnectionError("lost")
        assert budget.pulls == 0 and budget.bytes == 0
        async with budget.hold(5):
            assert budget.pulls == 1

    asyncio.run(main())


def test_bad_limits_are_refused():
    with pytest.raises(ValueError):
        InFlight(max_pulls=0, max_bytes=10)
    with pytest.raises(ValueError):
        InFlight(max_pulls=1, max_bytes=-1)
    with pytest.raises(ValueError):
        InFlight(max_pulls=1, max_bytes=1, min_patience_s=0)


def test_a_stalled_pull_stops_holding_up_the_next_after_its_patience():
    async def main():
        budget, log = InFlight(max_pulls=2, max_bytes=1000, min_patience_s=0.3), []
        stalled, second, third = asyncio.Event(), asyncio.Event(), asyncio.Event()
        loop = asyncio.get_running_loop()
        began = loop.time()
        tasks = [asyncio.create_task(_pull(budget, "stalled", 800, log, stalled))]
        await _settle()
        tasks.append(asyncio.create_task(_pull(budget, "second", 800, log, second)))
        tasks.append(asyncio.create_task(_pull(budget, "third", 800, log, third)))
        await asyncio.sleep(0.15)
        assert [entry[1] for entry in log] == ["stalled"]  # still within its patience
        while len(log) < 2:
            await asyncio.sleep(0.01)
        waited = loop.time() - began
        assert 0.25 < waited < 1.0
        # the stalled pull still counts as a pull, no longer as bytes; the third waits for a slot
        assert log[1] == ("start", "second", 2, 800) and budget.pulls == 2
        second.set()
        await _settle()
        assert log[-1][:2] == ("start", "third") and budget.bytes == 800
        stalled.set()
        third.set()
        await asyncio.gather(*tasks)
        assert budget.pulls == 0 and budget.bytes == 0

    asyncio.run(main())


def test_patience_follows_the_rate_of_recent_large_pulls():
    budget = InFlight(max_pulls=4, max_bytes=1 << 20, min_patience_s=3.0)
    assert budget.patience(10_000_000) == 3.0  # no rate measured yet
    budget.observe(1000, 10.0)  # small pulls measure latency, not the link: ignored
    assert budget.rate is None
    budget.observe(2_000_000, 2.0)
    assert budget.rate == 1_000_000 and budget.patience(4_000_000) == 8.0
    assert budget.patience(100_000) == 3.0
    budget.observe(1_000_000, 0.5)
    assert budget.rate == 1_500_000


def _announcement(owner: bytes) -> Announcement:
    return Announcement(owner, owner.decode(), b"\0" * 32, 10, 1, b"", True)


def test_each_peer_pulls_starting_after_itself_so_no_author_serves_two_at_first():
    owners = [b"a", b"b", b"c", b"d"]
    decided = [_announcement(o) for o in owners]
    orders = {me: [a.owner for a in pull_order(decided, me) if a.owner != me] for me in owners}
    assert orders[b"a"] == [b"b", b"c", b"d"] and orders[b"c"] == [b"d", b"a", b"b"]
    for step in range(3):  # at every step of serial pulling, each author serves exactly one peer
        assert sorted(order[step] for order in orders.values()) == owners
    assert [a.owner for a in pull_order(decided, b"stranger")] == owners


def test_pulls_cancelled_at_the_deadline_do_not_hold_the_round_past_a_grace():
    """A pull inside a call that does not give way to its cancellation is left to end on its own; the
    round goes on after CANCEL_GRACE_S, and the pulls that obey are cancelled."""

    async def obeys() -> None:
        await asyncio.sleep(60)

    async def ignores() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            await asyncio.sleep(3)  # as a libp2p dial to a peer that left, which wait_for waits out

    async def round_end() -> tuple[int, float, list[asyncio.Task]]:
        tasks = [asyncio.create_task(obeys()), asyncio.create_task(ignores())]
        await asyncio.sleep(0.01)
        started = time.monotonic()
        left = await abandon(tasks)
        elapsed = time.monotonic() - started
        for task in tasks:
            task.cancel()
        return left, elapsed, tasks

    left, elapsed, tasks = asyncio.run(round_end())
    assert left == 1
    assert CANCEL_GRACE_S <= elapsed < CANCEL_GRACE_S + 1
    assert tasks[0].cancelled()


def test_the_exchange_time_reported_grows_the_window_only_for_slow_pulls():
    from shoal.peer.swarm.coordinated import measured_exchange

    # all pulled: the time it took, whatever the last pull
    assert measured_exchange(100.0, 104.0, 103.0, missing=False, slow=False) == 4.0
    # missing at the deadline while bytes were still coming: the whole wait (the window may grow)
    assert measured_exchange(100.0, 110.0, 101.0, missing=True, slow=True) == 10.0
    # missing because no source could serve it: up to the last payload it got, 0 if none
    assert measured_exchange(100.0, 110.0, 101.5, missing=True, slow=False) == 1.5
    assert measured_exchange(100.0, 110.0, 100.0, missing=True, slow=False) == 0.0


def test_a_pull_counts_as_transferring_only_while_an_attempt_runs_long():
    from shoal.peer.swarm.counters import SwarmCounters
    from shoal.peer.swarm.pull import SLOW_ATTEMPT_S, Puller

    async def main():
        puller = Puller(
            None, run="r", channels=None, owner=b"me", timeout_s=1.0, max_concurrent=2,
            strike=lambda *_: None, counts=SwarmCounters(),
        )  # fmt: skip
        now = time.monotonic()
        assert not puller.transferring([b"a"], now)
        puller._attempts[b"a"] = now - SLOW_ATTEMPT_S / 2
        assert not puller.transferring([b"a", b"b"], now)
        assert puller.transferring([b"a"], now + SLOW_ATTEMPT_S)
        assert not puller.transferring([b"b"], now + SLOW_ATTEMPT_S)

    asyncio.run(main())


def test_a_payload_whose_sources_all_fail_at_once_is_not_transferring_but_a_stalled_one_is():
    from hivemind.p2p import P2PDaemonError

    from shoal.peer.swarm.counters import SwarmCounters
    from shoal.peer.swarm.pull import SLOW_ATTEMPT_S, Puller

    async def main():
        puller = Puller(
            None, run="r", channels=None, owner=b"me", timeout_s=1.0, max_concurrent=2,
            strike=lambda *_: None, counts=SwarmCounters(),
        )  # fmt: skip
        announcement = Announcement(b"au", "peer-au", b"d" * 32, 10, 1, b"", True)
        hang = asyncio.Event()

        async def failing(peer, _announcement, _request, _relay):
            if peer == "stalled":
                await hang.wait()
            raise P2PDaemonError("routing: not found")

        puller._checked = failing
        failed = asyncio.create_task(puller.payload(0, announcement, {}))
        await asyncio.sleep(SLOW_ATTEMPT_S + 0.3)
        assert not puller.transferring([announcement.digest])
        failed.cancel()
        stalled = dataclasses.replace(announcement, peer="stalled", digest=b"e" * 32)
        task = asyncio.create_task(puller.payload(0, stalled, {}))
        await asyncio.sleep(SLOW_ATTEMPT_S + 0.3)
        assert puller.transferring([stalled.digest])
        task.cancel()
        await asyncio.gather(failed, task, return_exceptions=True)
        assert not puller._attempts

    asyncio.run(main())


def test_a_peer_that_says_it_can_be_dialed_and_cannot_is_counted_once_and_reached_through_a_relay():
    from hivemind.p2p import P2PDaemonError

    from shoal.peer.swarm.counters import SwarmCounters
    from shoal.peer.swarm.pull import Puller

    async def main():
        counts = SwarmCounters()
        puller = Puller(
            None, run="r", channels=None, owner=b"me", timeout_s=1.0, max_concurrent=2,
            strike=lambda *_: None, counts=counts, relays_of=lambda _peer: ("relay",),
            claims_reachable=lambda peer: peer in ("liar", "honest-but-down"),
        )  # fmt: skip
        asked = []

        async def checked(peer, _announcement, _request, relay):
            asked.append(relay or peer)
            if relay is None:  # behind NAT, whatever its record says
                raise P2PDaemonError("routing: not found")
            return b"x" * 10

        puller._checked = checked
        liar = Announcement(b"l", "liar", b"d" * 32, 10, 1, b"", True)
        for round_number in range(3):
            assert await puller.payload(round_number, liar, {}) == b"x" * 10
        assert asked == ["liar", "relay"] * 3
        assert counts.rejected["false_reachable"] == 1 and puller.false_claims == {"liar"}
        # a peer behind NAT that says so is reached through the relay as well, and not counted
        honest = Announcement(b"h", "natted", b"e" * 32, 10, 1, b"", True)
        await puller.payload(0, honest, {})
        assert counts.rejected["false_reachable"] == 1 and counts.via_relay["payload"] == 40

    asyncio.run(main())
