"""Catch-up by replay (shoal.peer.swarm.replay): the steps a peer keeps and serves, their checks against
a hostile source, the plan a peer behind makes, and DiLoCo's replay of a round, which must give the
bits the round itself gave."""

import asyncio
import hashlib
import itertools

import pytest
import torch

from shoal.compression import DCTTopKCodec
from shoal.peer.algorithms.demo import DeMo
from shoal.peer.algorithms.diloco import DiLoCo
from shoal.peer.algorithms.exchange import Contribution, LoopbackExchange, run_loopback
from shoal.peer.models.gpt import GPTConfig, TinyGPT
from shoal.peer.swarm.counters import SwarmCounters
from shoal.peer.swarm.replay import (
    KEEP_STEPS,
    Counted,
    Step,
    Steps,
    encode,
    parse_steps,
    plan_replay,
)
from shoal.peer.swarm.server import PayloadServer
from shoal.peer.swarm.stages import RoundLimits, RoundStages
from shoal.peer.swarm.state import StateSnapshot, state_size
from shoal.protocol import MalformedPayloadError
from shoal.protocol.swarm_pb2 import StateSteps


def digest(name: str) -> bytes:
    return hashlib.sha256(name.encode()).digest()


def counted(owner: str, payload: str, size: int = 100) -> Counted:
    return Counted(owner.encode(), digest(payload), samples=8, size=size)


def step(number: int, before: str, *payloads: str) -> Step:
    return Step(number, digest(before), tuple(counted(f"owner{i}", p) for i, p in enumerate(payloads)))


def test_steps_chain_back_from_a_state_to_the_oldest_kept():
    steps = Steps(keep=3)
    for number in range(5):  # s0 -> s1 -> ... -> s5
        steps.record(digest(f"s{number + 1}"), step(number, f"s{number}", f"p{number}"))
    assert len(steps) == 3
    assert [s.round for s in steps.chain(digest("s5"))] == [4, 3, 2]
    assert [s.round for s in steps.chain(digest("s4"))] == [3, 2]
    assert steps.chain(digest("s2")) == [] and steps.chain(digest("unknown")) == []


def test_steps_travel_and_come_back_as_they_were():
    chain = [step(7, "s7", "a", "b"), step(6, "s6"), step(5, "s5", "c")]
    assert parse_steps(encode(chain), max_payload_bytes=1000) == chain
    assert parse_steps(b"", max_payload_bytes=1000) == []


@pytest.mark.parametrize(
    ("chain", "reason"),
    [
        ([step(10 - i, f"s{i}") for i in range(KEEP_STEPS + 1)], "bad_steps"),
        ([step(3, "a"), step(3, "b")], "bad_steps"),  # rounds must fall
        ([step(3, "a"), step(4, "b")], "bad_steps"),
        ([Step(3, b"short", ())], "bad_steps"),
        ([Step(3, digest("a"), (Counted(b"o", b"short", 1, 1),))], "bad_steps"),
        ([Step(3, digest("a"), (Counted(b"", digest("p"), 1, 1),))], "bad_steps"),
        ([Step(3, digest("a"), (Counted(b"o", digest("p"), 0, 1),))], "bad_steps"),
        ([Step(3, digest("a"), (Counted(b"o" * 2000, digest("p"), 1, 1),))], "bad_steps"),
        ([Step(3, digest("a"), (Counted(b"o", digest("p"), 1, 0),))], "too_large"),
        ([Step(3, digest("a"), (Counted(b"o", digest("p"), 1, 1001),))], "too_large"),
        # owners out of order, or one twice: the round's order is its owners'
        ([Step(3, digest("a"), (counted("b", "p"), counted("a", "q")))], "bad_steps"),
        ([Step(3, digest("a"), (counted("a", "p"), counted("a", "q")))], "bad_steps"),
    ],
)
def test_a_hostile_sources_steps_are_refused_by_reason(chain, reason):
    with pytest.raises(MalformedPayloadError) as refused:
        parse_steps(encode(chain), max_payload_bytes=1000)
    assert refused.value.reason == reason


def test_garbage_and_oversized_replies_are_refused():
    with pytest.raises(MalformedPayloadError):
        parse_steps(b"\xff\xff\xff", max_payload_bytes=1000)
    huge = StateSteps(steps=[encode_step() for _ in range(1)]).SerializeToString() + b"\x00" * (5 << 20)
    with pytest.raises(MalformedPayloadError):
        parse_steps(huge, max_payload_bytes=1000)


def encode_step():
    return StateSteps.FromString(encode([step(1, "a")])).steps[0]


def test_the_plan_starts_at_the_newest_state_held_and_pulls_only_what_is_missing():
    chain = [step(9, "s9", "a9", "b9"), step(8, "s8", "a8", "b8"), step(7, "s7", "a7")]
    held = {(9, digest("a9")), (8, digest("a8")), (8, digest("b8"))}

    def holds(number, payload):
        return (number, payload) in held

    plan = plan_replay(chain, {digest("s8"), digest("s7")}, holds)
    assert plan is not None and plan.start == digest("s8")
    assert [s.round for s in plan.steps] == [8, 9]
    assert plan.missing == ((9, counted("owner1", "b9")),) and plan.bytes == 100
    plan = plan_replay(chain, {digest("s7")}, holds)
    assert plan is not None and [s.round for s in plan.steps] == [7, 8, 9] and plan.bytes == 200
    assert plan_replay(chain, {digest("elsewhere")}, holds) is None
    assert plan_replay([], {digest("s7")}, holds) is None


# -- DiLoCo's replay gives the round's own bits ----------------------------------------------------

CONFIG = GPTConfig.preset("tiny", n_layer=1, d_model=32, seq_len=16)
torch.manual_seed(0)
INITIAL = TinyGPT(CONFIG).state_dict()


class Recording(LoopbackExchange):
    """A loopback exchange that keeps each round's state and contributions, and the optimizer's replay;
    untrusted, as the swarm's: the optimizer screens each round with the swarm's defaults."""

    def __init__(self, hub, rank, gather_limit=0, *, replay_at_once=False):
        super().__init__(hub, rank, gather_limit, trusted=False)
        self.rounds: list[tuple[list[torch.Tensor], list]] = []
        self.replay = None
        self.replay_at_once = replay_at_once
        """Replay each round as it is gathered, screened as the round itself is (with the record of
        suspicion the round starts from), into `replayed`."""
        self.replayed: list = []

    def replays_with(self, replay):
        self.replay = replay

    def gather(self, payload, samples, state=None, plan=None):
        gathered = super().gather(payload, samples, state, plan)
        number, state = len(self.rounds), [t.clone() for t in state or ()]
        self.rounds.append((state, list(gathered.contributions)))
        if self.replay_at_once:
            before = [t.clone() for t in state]
            self.replayed.append(self.replay(state, list(gathered.contributions), (number, number + 1)))
            assert all(torch.equal(x, y) for x, y in zip(state, before, strict=True))  # left as it was
        return gathered


@pytest.mark.parametrize(
    ("mode", "sparse"), [("standard", False), ("eager", False), ("eager", True), ("delayed", False)]
)
def test_diloco_replays_a_round_to_the_bits_the_round_gave(mode, sparse):
    """Three workers, screened as the swarm screens (its defaults: `Recording` is untrusted), momentum
    on: replaying round i on round i's state gives round i + 1's state bit for bit, and leaves the state
    handed in as it was."""
    group = LoopbackExchange.group(3)
    exchanges = [Recording(group[0]._hub, rank) for rank in range(3)]

    def work(rank, _exchange):
        exchange = exchanges[rank]
        model = TinyGPT(CONFIG)
        model.load_state_dict(INITIAL)
        generator = torch.Generator().manual_seed(1000 + rank)
        codec = DCTTopKCodec(topk=8, value_bits=8) if sparse else None
        inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
        with DiLoCo(
            model, inner, exchange=exchange, inner_steps=2, mode=mode, outer_momentum=0.9, codec=codec
        ) as diloco:
            for _ in range(10):
                tokens = torch.randint(0, 256, (4, CONFIG.seq_len + 1), generator=generator)
                model(tokens[:, :-1], targets=tokens[:, 1:]).backward()
                diloco.step(samples=4)
            diloco.finish()
            return exchange.replay, [t.clone() for t in diloco.shared_state()]

    (replay, end), *_ = run_loopback(3, work)
    rounds = exchanges[0].rounds
    states = [state for state, _ in rounds] + [end]
    assert len(rounds) == 5
    for (state, contributions), after in zip(rounds, states[1:], strict=True):
        before = [t.clone() for t in state]
        replayed, rejected = replay(state, contributions)
        assert rejected == []
        assert all(torch.equal(x, y) for x, y in zip(replayed, after, strict=True))
        assert all(torch.equal(x, y) for x, y in zip(state, before, strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(states[0], states[-1], strict=True))


def test_diloco_replay_rejects_a_malformed_contribution_and_a_state_of_another_shape():
    model = TinyGPT(CONFIG)
    exchange = Recording(LoopbackExchange.group(1)[0]._hub, 0)
    with DiLoCo(model, torch.optim.AdamW(model.parameters()), exchange=exchange, inner_steps=1) as diloco:
        state = diloco.shared_state()
        replay = exchange.replay
        after, rejected = replay(state, [Contribution(0, b"\x00garbage", 4, sender=b"bad")])
        assert rejected == [b"bad"]
        assert all(torch.equal(x, y) for x, y in zip(after, state, strict=True))  # nothing counted
        assert replay(state[:-1], []) is None


# -- a peer behind: replay, or a download that says why (RoundStages.replay) -----------------------


class Sources:
    """What the other peers answer a peer that replays: their steps, and the payloads they keep."""

    def __init__(self, steps: bytes, kept: dict[bytes, bytes]):
        self.steps_reply, self.kept_payloads, self.asked = steps, kept, []

    async def steps(self, digest, source):
        self.asked.append(source)
        return self.steps_reply

    async def kept(self, round_number, counted, sources):
        return self.kept_payloads.get(counted.digest)


def behind(steps: bytes, kept: dict[bytes, bytes], transition):
    """A RoundStages whose state of round 5 (zeros) is held, with `transition`, over these sources."""
    counts = SwarmCounters()
    server = PayloadServer(run="r", counts=counts, max_payload_bytes=1 << 20, keep_states=3, timeout_s=1)
    held = StateSnapshot.capture([torch.zeros(4096)], 5)
    server.keep_state(held)
    stages = RoundStages(
        run="r", owner=b"me", peer_id="me", server=server, directory=None, ledger=None,
        puller=Sources(steps, kept), counts=counts, limits=RoundLimits(1 << 20, 1.0, 0.1, 0),
    )  # fmt: skip
    stages.transition = transition
    return stages, held


def add_payloads(state, step, payloads, starts):
    """A transition of a test: each payload's value (one float32) added to the whole state."""
    total = state[0].clone()
    for payload in payloads:
        total += torch.frombuffer(bytearray(payload), dtype=torch.float32)[0]
    return [total]


def payload(value: float) -> bytes:
    return torch.tensor([value]).numpy().tobytes()


def test_a_peer_behind_replays_the_steps_and_pulls_only_what_it_lacks():
    one, two = payload(1.0), payload(2.0)
    stages, held = behind(b"", {}, add_payloads)
    step = Step(5, held.digest, (Counted(b"a", hashlib.sha256(one).digest(), 1, len(one)),
                                 Counted(b"b", hashlib.sha256(two).digest(), 1, len(two))))  # fmt: skip
    stages.puller.steps_reply = encode([step])
    stages.puller.kept_payloads = {hashlib.sha256(two).digest(): two}
    stages.server.held[(5, hashlib.sha256(one).digest())] = one  # pulled in round 5 already
    target = StateSnapshot.capture([torch.full((4096,), 3.0)], 6).digest
    state = asyncio.run(stages.replay(6, target, ["peer"], [torch.zeros(4096)]))
    assert state is not None and torch.equal(state[0], torch.full((4096,), 3.0))
    counts = stages.counts
    assert counts.replays == 1 and counts.replayed_state_bytes == state_size([torch.zeros(4096)])
    assert counts.replay_bytes == len(two) + len(encode([step]))  # the missing payload and the steps
    assert not counts.rejected


def test_steps_no_peer_kept_a_payload_gone_a_lie_or_garbage_fall_back_to_the_download_counted():
    two = payload(2.0)
    target = StateSnapshot.capture([torch.full((4096,), 2.0)], 6).digest

    def attempt(steps, kept, transition=add_payloads):
        stages, _ = behind(steps(held_digest()), kept, transition)
        state = asyncio.run(stages.replay(6, target, ["peer", "other", "third"], [torch.zeros(4096)]))
        assert state is None and stages.counts.replays == 0
        return stages

    def held_digest():
        return StateSnapshot.capture([torch.zeros(4096)], 5).digest

    def one_step(before):
        return encode([Step(5, before, (Counted(b"b", hashlib.sha256(two).digest(), 1, len(two)),))])

    # no peer keeps steps from here: asked of two sources at most, then the download, counted
    stages = attempt(lambda _: b"", {})
    assert stages.counts.rejected == {"replay_unavailable": 1} and stages.puller.asked == ["peer", "other"]
    # steps from a state this peer does not hold
    assert attempt(lambda _: one_step(digest("elsewhere")), {}).counts.rejected == {"replay_unavailable": 1}
    # the payload is kept by no one
    assert attempt(one_step, {}).counts.rejected == {"replay_unavailable": 1}
    # a source that lies: the steps lead elsewhere than the swarm's digest
    lie = {hashlib.sha256(two).digest(): two}
    assert attempt(one_step, lie, lambda s, *_: [s[0] + 7]).counts.rejected == {"replay_mismatch": 1}
    # garbage instead of steps, from both sources
    garbage = attempt(lambda _: b"\xff\xff\xff", {}).counts.rejected
    assert garbage["replay_unavailable"] == 1 and sum(garbage.values()) == 3
    # the optimizer cannot replay the step after all (a state of another shape): the download
    assert attempt(one_step, lie, lambda *_: None).counts.replay_bytes == len(one_step(held_digest())) + 4
    # an optimizer that replays nothing (DeMo, butterfly rounds): nothing asked, nothing counted
    none = attempt(one_step, lie, None)
    assert none.puller.asked == [] and none.counts.replay_bytes == 0 and not none.counts.rejected


def test_replaying_costs_more_than_the_state_then_it_downloads_without_pulling():
    big = [Counted(bytes([i + 1]), digest(f"p{i}"), 1, 8192) for i in range(3)]
    stages, held = behind(b"", {}, add_payloads)
    stages.puller.steps_reply = encode([Step(5, held.digest, tuple(big))])
    target = StateSnapshot.capture([torch.zeros(4096)], 6).digest
    assert asyncio.run(stages.replay(6, target, ["peer"], [torch.zeros(4096)])) is None
    assert stages.counts.replays == 0 and not stages.counts.rejected


def schedule(number: int) -> float:
    """A learning rate that changes every round, as a warmup's or a decay's does."""
    return 1e-2 * (1 + 0.25 * number)


@pytest.mark.parametrize("overlap,canonical", [(False, True), (True, False)])
def test_demo_replays_a_round_to_the_bits_the_round_gave(overlap, canonical):
    """Three DeMo workers, screened as the swarm screens, with weight decay and a rate that changes
    every round (`lr_at`, a schedule's): replaying round i on round i's parameters gives round i + 1's
    bit for bit, whether the sign step lands in its own step or, overlapped (with the lookahead), in
    the next one, with the exact inverse DCT or the float one."""
    group = LoopbackExchange.group(3)
    exchanges = [Recording(group[0]._hub, rank, replay_at_once=True) for rank in range(3)]

    def work(rank, _exchange):
        exchange = exchanges[rank]
        model = TinyGPT(CONFIG)
        model.load_state_dict(INITIAL)
        generator = torch.Generator().manual_seed(2000 + rank)
        optimizer = DeMo(
            model.parameters(), lr=schedule(0), exchange=exchange, weight_decay=0.1, compression_topk=8,
            overlap=overlap, lookahead=overlap, canonical=canonical,
        )  # fmt: skip
        optimizer.lr_at = schedule
        for number in range(6):
            for group_ in optimizer.param_groups:
                group_["lr"] = schedule(number)
            tokens = torch.randint(0, 256, (4, CONFIG.seq_len + 1), generator=generator)
            model(tokens[:, :-1], targets=tokens[:, 1:]).backward()
            optimizer.step(samples=4)
            optimizer.zero_grad()
        optimizer.close()
        return exchange.replay

    replay, *_ = run_loopback(3, work)
    rounds, replayed = exchanges[0].rounds, exchanges[0].replayed
    assert len(rounds) == 6
    for number, ((state, _), (after, _)) in enumerate(itertools.pairwise(rounds)):
        assert replayed[number][1] == []
        assert all(torch.equal(x, y) for x, y in zip(replayed[number][0], after, strict=True)), number
        assert not all(torch.equal(x, y) for x, y in zip(state, after, strict=True))  # it moved
    # and the rate matters: the next round's gives other bits
    state, contributions = rounds[0]
    other, _ = replay(state, contributions, (1, 2))
    assert not all(torch.equal(x, y) for x, y in zip(other, rounds[1][0], strict=True))
