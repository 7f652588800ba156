"""Bounded fan-in (`--gather G`, shoal.protocol.rules): the choice rule, and the optimizers
keeping the work that did not count."""

import collections
import math

import pytest
import torch

from shoal.compression import decode_tensor
from shoal.peer.algorithms.demo import DeMo
from shoal.peer.algorithms.diloco import DiLoCo
from shoal.peer.algorithms.exchange import Exchange, Gathered, LoopbackExchange, run_loopback
from shoal.peer.algorithms.robust import NONE
from shoal.protocol import Payload
from shoal.protocol.rules import choose, eligible

KEYS = [bytes([i]) * 4 for i in range(16)]


def rotate(keys: list[bytes], limit: int, rounds: int, start: int = 0) -> tuple[collections.Counter, int]:
    """Runs the rule over `rounds` rounds from `start`: (times each key counted, longest wait in rounds)."""
    times, waits, longest = collections.Counter(), dict.fromkeys(keys, 0), 0
    for number in range(start, start + rounds):
        chosen = choose(b"run", number, keys, limit)
        assert len(chosen) == limit
        for key in keys:
            if key in chosen:
                times[key], waits[key] = times[key] + 1, 0
            else:
                waits[key] += 1
                longest = max(longest, waits[key])
    return times, longest


def test_everyone_counts_without_a_limit_or_with_few_candidates():
    claims = {key: 8 for key in KEYS[:3]}
    assert choose(b"run", 0, claims, 0) == set(claims)
    assert choose(b"run", 0, claims, 3) == set(claims)
    assert choose(b"run", 0, {}, 2) == set()
    with pytest.raises(ValueError, match="limit"):
        choose(b"run", 0, claims, -1)


def test_every_peer_that_sees_the_same_candidates_chooses_the_same_set():
    assert choose(b"run", 7, KEYS, 4) == choose(b"run", 7, list(reversed(KEYS)), 4)
    assert len({choose(b"run", number, KEYS, 4) for number in range(8)}) > 1
    assert choose(b"other", 7, KEYS, 4) != choose(b"run", 7, KEYS, 4)


def test_every_candidate_counts_once_a_cycle():
    times, longest = rotate(KEYS, limit=4, rounds=40)
    assert set(times.values()) == {10}  # G / N of the rounds, exactly
    assert longest <= 2 * (16 // 4 - 1)  # at worst first in one cycle, last in the next
    for number in range(0, 40, 4):  # one cycle of N / G rounds: each key once
        cycle = [choose(b"run", number + i, KEYS, 4) for i in range(4)]
        assert frozenset().union(*cycle) == set(KEYS) and sum(map(len, cycle)) == 16


@pytest.mark.parametrize(("count", "limit"), [(5, 2), (6, 4), (7, 3), (3, 2)])
def test_an_uneven_rotation_gives_everyone_its_share_every_cycle(count, limit):
    keys = KEYS[:count]
    cycle = count // math.gcd(count, limit)
    for start in range(0, 10 * cycle, cycle):
        times, _ = rotate(keys, limit, cycle, start)
        assert set(times.values()) == {cycle * limit // count}
    times, longest = rotate(keys, limit, 7 * cycle + 1)  # and within a cycle, near it
    assert min(times.values()) >= 0.8 * (7 * cycle + 1) * limit / count
    assert longest <= 2 * -(-count // limit)


def test_only_announcers_on_the_majority_state_are_candidates():
    """A contribution computed on another state cannot count: its announcer takes no slot (a random
    digest took a third of the slots, unstruck, issue 47). Only peers in sync vote, as in the state
    vote; with no state announced, everyone is a candidate."""
    s1, s2, s3 = b"\x01" * 32, b"\x02" * 32, b"\x03" * 32
    states = {KEYS[0]: (s1, True), KEYS[1]: (s1, True), KEYS[2]: (s2, True), KEYS[3]: (s3, True)}
    assert eligible(states) == [KEYS[0], KEYS[1]]
    states.update({KEYS[4]: (s2, False), KEYS[5]: (s2, False)})  # joiners do not outvote the swarm
    assert eligible(states) == [KEYS[0], KEYS[1]]
    assert eligible({KEYS[0]: (b"", False), KEYS[1]: (b"", False)}) == KEYS[:2]


def test_a_claim_beyond_belief_takes_no_slot_judged_among_the_majority_state():
    """2^40 samples cannot count (robust.overclaims), so it takes no slot either: before, 2 of 8 held
    theirs until strikes from the rounds they were chosen in banned them, 12 rounds, and again after
    every ban. The bound is judged among the candidates on the majority's state only."""
    s1, s2 = b"\x01" * 32, b"\x02" * 32
    states = dict.fromkeys(KEYS[:6], (s1, True)) | {KEYS[6]: (s2, True)}
    claims = dict.fromkeys(KEYS[:7], 10) | {KEYS[4]: 640, KEYS[5]: 641, KEYS[6]: 1}
    assert eligible(states, claims) == [*KEYS[:5]]  # 64x the lower median, 10, is believable
    assert eligible(states, claims | {KEYS[0]: 2**40}) == KEYS[1:5]
    assert eligible(states) == KEYS[:6]


def test_a_claim_buys_nothing():
    """`choose` reads no claim: a peer that says it trained 2^40 samples is chosen as often as any
    (`eligible` then leaves a claim beyond belief out of the candidates, above)."""
    honest = dict.fromkeys(KEYS[:4], 10)
    lying = {**honest, KEYS[3]: 2**40}
    for number in range(40):
        assert choose(b"run", number, lying, 2) == choose(b"run", number, honest, 2)
    times, _ = rotate(KEYS[:4], limit=2, rounds=40)
    assert times[KEYS[3]] == 20


class _Nobody(Exchange):
    """A round in which no payload counted (every chosen one vanished); for unit tests only."""

    rank = property(lambda self: 0)
    world_size = property(lambda self: 1)

    def __init__(self):
        self.claims: list[int] = []
        self.payloads: list[bytes] = []

    def gather(self, payload, samples, state=None, plan=None) -> Gathered:
        self.claims.append(samples)
        self.payloads.append(payload)
        return Gathered(counted=False)

    def mean(self, tensor, weight=1.0):
        raise NotImplementedError


def test_demo_with_carry_takes_an_uncounted_payload_back_into_its_momentum_exactly():
    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(64, 96, generator=generator) for _ in range(4)]
    kept, carried = torch.nn.Parameter(torch.zeros(64, 96)), torch.nn.Parameter(torch.zeros(64, 96))
    # error_feedback 0 never removes what it sends: the momentum an uncounted payload must leave
    reference = DeMo([kept], lr=0.1, exchange=_Nobody(), error_feedback=0.0, compression_topk=4, robust=NONE)
    nobody = _Nobody()
    optimizer = DeMo([carried], lr=0.1, exchange=nobody, compression_topk=4, robust=NONE, carry=True)
    for grad in grads:
        kept.grad, carried.grad = grad.clone(), grad.clone()
        reference.step(samples=8)
        optimizer.step(samples=8)
    assert torch.equal(optimizer.state[carried]["delta"], reference.state[kept]["delta"])
    assert optimizer.stats.uncounted == 4 and reference.stats.uncounted == 4
    assert nobody.claims == [8, 16, 24, 32]  # the samples behind the carried work, announced
    assert torch.equal(kept, carried)  # nothing counted: no step


def test_demo_without_carry_claims_only_the_samples_of_its_payload():
    momenta = {}
    for carry in (False, True):
        nobody, param = _Nobody(), torch.nn.Parameter(torch.zeros(64, 96))
        optimizer = DeMo([param], lr=0.1, exchange=nobody, compression_topk=4, robust=NONE, carry=carry)
        for seed in range(3):
            param.grad = torch.randn(64, 96, generator=torch.Generator().manual_seed(seed))
            optimizer.step(samples=8)
        assert nobody.claims == ([8, 16, 24] if carry else [8, 8, 8]) and optimizer.stats.uncounted == 3
        momenta[carry] = optimizer.state[param]["delta"]
    # without carry, what was sent stays out of the momentum (plain error feedback)
    assert momenta[True].abs().sum() > momenta[False].abs().sum()


def _demo_workers(limit: int, overlap: bool) -> list[tuple[list[torch.Tensor], DeMo]]:
    generator = torch.Generator().manual_seed(1)
    grads = [[torch.randn(48, 64, generator=generator) for _ in range(4)] for _ in range(6)]

    def work(rank: int, exchange: LoopbackExchange):
        param = torch.nn.Parameter(torch.zeros(48, 64))
        optimizer = DeMo([param], lr=0.1, exchange=exchange, compression_topk=4, overlap=overlap)
        for step in grads:
            param.grad = step[rank].clone()
            optimizer.step(samples=8)
        optimizer.finish()
        optimizer.close()
        return param.detach(), optimizer

    return run_loopback(4, work, gather_limit=limit, trusted=False)  # screened, as swarm peers


@pytest.mark.parametrize("overlap", [False, True])
def test_demo_under_a_bounded_fan_in_keeps_every_worker_identical_and_rotates(overlap):
    results = _demo_workers(2, overlap)
    params = [param for param, _ in results]
    assert all(torch.equal(params[0], other) for other in params[1:])
    uncounted = [optimizer.stats.uncounted for _, optimizer in results]
    assert sum(uncounted) == 2 * 6  # two of four left out of each of six rounds
    assert max(uncounted) <= 4 and min(uncounted) >= 2  # a round-robin: each counts every other round
    assert not torch.equal(params[0], _demo_workers(0, overlap)[0][0])


@pytest.mark.parametrize("carry", [False, True])
@pytest.mark.parametrize("mode", ["standard", "eager"])
def test_diloco_under_a_bounded_fan_in_keeps_every_worker_identical_and_rotates(mode, carry):
    torch.manual_seed(0)
    initial = torch.nn.Linear(16, 4).state_dict()

    def work(rank: int, exchange: LoopbackExchange):
        model = torch.nn.Linear(16, 4)
        model.load_state_dict(initial)
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        diloco = DiLoCo(model, inner, exchange=exchange, inner_steps=2, mode=mode, robust=NONE, carry=carry)
        generator = torch.Generator().manual_seed(rank)
        for _ in range(12):
            x = torch.randn(8, 16, generator=generator)
            model(x).pow(2).mean().backward()
            diloco.step(samples=8)
        diloco.finish()
        diloco.close()
        return [p.detach().clone() for p in model.parameters()], diloco.stats.uncounted

    results = run_loopback(4, work, gather_limit=1)
    params = [param for param, _ in results]
    assert all(torch.equal(a, b) for other in params[1:] for a, b in zip(params[0], other, strict=True))
    assert all(3 <= uncounted <= 5 for _, uncounted in results)  # each counts once or twice in six
    assert sum(uncounted for _, uncounted in results) == 3 * 6  # three of four left out of six rounds


def test_diloco_with_carry_sends_the_mean_over_the_phases_it_waited():
    torch.manual_seed(0)
    initial = torch.nn.Linear(16, 4).state_dict()

    def payloads(carry: bool) -> _Nobody:
        model, nobody = torch.nn.Linear(16, 4), _Nobody()
        model.load_state_dict(initial)
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        diloco = DiLoCo(model, inner, exchange=nobody, inner_steps=2, robust=NONE, carry=carry)
        generator = torch.Generator().manual_seed(3)
        for _ in range(4):  # two rounds; nothing counts, so the global parameters stay where they were
            model(torch.randn(8, 16, generator=generator)).pow(2).mean().backward()
            diloco.step(samples=8)
        return nobody

    def decoded(payload: bytes) -> list[torch.Tensor]:
        return [decode_tensor(message) for message in Payload.FromString(payload).tensors]

    carried, fresh = payloads(True), payloads(False)
    assert carried.claims == [16, 32]  # the samples behind the carried phase are claimed again
    assert fresh.claims == [16, 16]  # without carry the work left out is lost: so are its samples
    first, second = decoded(fresh.payloads[0]), decoded(fresh.payloads[1])
    for got, a, b in zip(decoded(carried.payloads[1]), first, second, strict=True):
        torch.testing.assert_close(got, (a + b) / 2)
