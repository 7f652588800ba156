"""The token ledger's core (shoal.peer.data.ledger): a simulated churning swarm, each peer with its own
ledger, covers every window of the first epoch exactly once, counting only what counted."""

import random
from collections import Counter

import numpy as np
import pytest

from shoal.peer.data.ledger import Claim, TokenLedger

WINDOWS, STRIDE = 203, 4  # the epoch's last chunk is short


def _run_swarm(lag: int, seed: int) -> tuple[dict[bytes, TokenLedger], Counter, int]:
    """Peers come and go (a joiner adopts a member's ledger of the round it joins), train as many
    micro-batches as they like (some halved), and a quarter of the payloads do not count, one in ten
    rounds one is rejected; each peer records the counted claims and settles `lag` rounds late. Returns
    the ledgers, how often each window of epoch 0 was trained by a credited payload (from what the
    peers trained, not from the ledger), and the rounds run."""
    rng = random.Random(seed)
    names = [bytes([i]) * 4 for i in range(8)]
    ledgers = {name: TokenLedger(WINDOWS, STRIDE, seed=7, lag=lag) for name in names[:3]}
    trained: dict[tuple[int, bytes], list[tuple[np.ndarray, np.ndarray]]] = {}
    credited_by_round: dict[int, set[bytes]] = {}
    number = 0
    for number in range(400):
        members = sorted(ledgers)
        lanes = {}
        for slot, name in enumerate(members):
            ledger = ledgers[name]
            lane = ledger.lane(number, slot, len(members))
            parts = []
            for step in range(rng.randint(1, 2)):
                size = rng.choice([STRIDE, STRIDE // 2])
                for micro in range(rng.randint(1, 3) * (STRIDE // size)):
                    parts.append(ledger.batch(lane, step, micro, size))
            trained[(number, name)] = parts
            lanes[name] = lane
        for ledger in ledgers.values():  # the round's aggregate is due: the last one was applied
            ledger.view(number)
        watcher = ledgers[members[0]]
        for done, result in watcher.recent.items():
            credited_by_round.setdefault(done, {s for s, w in result.credited.items() if w})
        counted = {n: lane.claim() for n, lane in lanes.items() if rng.random() < 0.75}
        rejected = next(iter(counted), None) if rng.random() < 0.1 else None
        for ledger in ledgers.values():
            ledger.record(number, counted)
            if rejected is not None:
                ledger.reject(number, rejected)
        if rng.random() < 0.08 and len(ledgers) > 2:
            del ledgers[rng.choice(sorted(ledgers))]
        if rng.random() < 0.08 and len(ledgers) < len(names):
            joiner = rng.choice([n for n in names if n not in ledgers])
            fresh = TokenLedger(WINDOWS, STRIDE, seed=7, lag=lag)
            fresh.load(ledgers[sorted(ledgers)[0]].view(number), number)
            fresh.record(number, counted)
            if rejected is not None:
                fresh.reject(number, rejected)
            ledgers[joiner] = fresh
        if all(ledger.epochs.min() >= 1 for ledger in ledgers.values()):
            break
    coverage: Counter[int] = Counter()
    for done, senders in credited_by_round.items():
        for sender in senders:
            for ids, epochs in trained[(done, sender)]:
                coverage.update(ids[epochs == 0].tolist())
    return ledgers, coverage, number


@pytest.mark.parametrize("lag", [0, 1])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_churning_swarm_covers_the_first_epoch_exactly_once(lag, seed):
    ledgers, coverage, rounds = _run_swarm(lag, seed)
    assert rounds < 399, "the first epoch never ended"
    views = {ledger.view(rounds + 1) for ledger in ledgers.values()}
    assert len(views) == 1, "the peers' ledgers differ"
    twice = sorted(w for w, n in coverage.items() if n > 1)
    never = sorted(set(range(WINDOWS)) - set(coverage))
    assert not twice and not never, f"trained twice: {twice}; never: {never}"


def test_ledger_bytes_round_trip_and_refuse_another_corpus():
    ledger = TokenLedger(100, 4, seed=3, lag=1)
    lane = ledger.lane(0, 0, 1)
    lane.take(0, 0, 8)
    ledger.record(0, {b"a": lane.claim()})
    ledger.settle(0)
    assert ledger.done.sum() == 2
    copy = TokenLedger(100, 4, seed=3, lag=1)
    copy.load(ledger.to_bytes())
    assert copy.to_bytes() == ledger.to_bytes() and copy.digest(0) == ledger.digest(0)
    with pytest.raises(ValueError, match="another corpus"):
        TokenLedger(104, 4, seed=3, lag=1).load(ledger.to_bytes())
    with pytest.raises(ValueError, match="bytes"):
        copy.load(b"\0" * 5)
    assert copy.progress() == (0, 8 / 100, 8)


def test_hostile_claims_are_not_credited():
    ledger = TokenLedger(100, 4, seed=3)
    digest = ledger.lane(0, 0, 2).digest
    ledger.record(
        0,
        {
            b"a": Claim(0, 5, 2, 8, digest),  # a slot outside the slots
            b"b": Claim(0, 0, 2, -1, digest),
            b"c": Claim(0, 0, 2, 8, b"x" * 16),  # drawn from another ledger
            b"d": Claim(1, 0, 2, 8, digest),  # another round's
            b"e": Claim(0, 1, 2, 1 << 32, digest),  # more than a peer can train in a round
        },
    )
    result = ledger.settle(0)
    assert result.credited == {} and not ledger.done.any()
    assert result.unledgered == 8 + 8 + 8 - 1 + (1 << 32)


def test_a_lane_wraps_past_the_corpus_without_crediting_twice():
    ledger = TokenLedger(10, 2, seed=3, most_places=64)  # 5 chunks, one slot of two trains 40 places
    lane = ledger.lane(0, 1, 2)
    ids, epochs = ledger.window_ids(lane, 0, 40)
    assert len(ids) == 40 and set(epochs.tolist()) == {0, 1}
    lane.windows = 40
    ledger.record(0, {b"a": lane.claim()})
    result = ledger.settle(0)
    # its own lane: chunks 1 and 3 of epoch 0, then 0, 2 and 4 of epoch 1; the rest wrapped around
    assert result.credited == {b"a": 10} and result.duplicates == 30
    assert ledger.epochs.tolist() == [0] and ledger.done.sum() == 5


def test_a_claim_rides_on_a_payload_and_is_read_back_without_its_tensors():
    from shoal.peer.data.claims import claim_of, view_bytes, view_tensor
    from shoal.protocol.payload_pb2 import Payload
    from shoal.protocol.tensor_pb2 import EncodedTensor

    ledger = TokenLedger(100, 4, seed=3)
    lane = ledger.lane(5, 1, 3)
    lane.take(0, 0, 4)
    body = Payload(tensors=[EncodedTensor(shape=[3], values=b"\0" * 12)]).SerializeToString()
    data = body + lane.claim_bytes()
    assert claim_of(data) == lane.claim() and claim_of(body) is None
    assert len(Payload.FromString(data).tensors) == 1  # the optimizer reads the tensors as before
    for broken in (data[:-3], b"\xff" * 11, data + b"\x0f"):  # truncated, a runaway varint, wire type 7
        assert claim_of(broken) is None
    with pytest.raises(ValueError, match="not a ledger"):
        view_bytes(view_tensor(ledger.to_bytes()) + 0.5, ledger.size_bytes)
    with pytest.raises(ValueError, match="not a ledger"):
        view_bytes(view_tensor(ledger.to_bytes())[:-1], ledger.size_bytes)


def test_settlements_chain_by_digest_and_replays_on_an_adopted_ledger_are_told_once():
    """Each settlement names its class's digest before and after it, so that the history of the ledger
    a swarm ends on can be read back across re-syncs; a round settled again on an adopted ledger is
    handed out once as a replay."""
    ledger, other = TokenLedger(100, 4, seed=3), TokenLedger(100, 4, seed=3)
    start = ledger.digest(0)
    settled = []
    for number in range(2):
        lane = ledger.lane(number, 0, 1)
        lane.take(0, 0, 8)
        ledger.record(number, {b"a": lane.claim()})
        settled.append(ledger.settle(number))
    first, second = settled
    assert (first.before, first.after, second.before) == (start, second.before, first.after)
    assert second.after == ledger.digest(0) and second.after != start and not second.replayed
    empty = other.settle(0)  # nothing recorded: nothing changes
    assert empty.before == empty.after == start
    assert ledger.replays() == []
    ledger.load(TokenLedger(100, 4, seed=3).to_bytes(), 1)  # a view from before round 0: 0 and 1 again
    replays = ledger.replays()
    assert [(r.round, r.replayed) for r in replays] == [(0, True), (1, True)] and ledger.replays() == []
    assert replays[0].before == start and replays[-1].after == ledger.digest(0)


def test_a_peer_s_own_micro_batch_cap_is_not_part_of_the_run_s_ledger():
    """`--max-micro-batches` is each peer's (shoal demo's peers lower it to 64): the ledger every peer
    pins in the run configuration, and its bound on a claim, are the same whatever it is, so a peer
    that lowers it joins the others, and a peer at the default has its whole claim credited by one
    that lowered it."""
    from types import SimpleNamespace

    from shoal.peer.config.spec import MOST_MICRO_BATCHES, PeerSpec
    from shoal.peer.job.assembly import token_ledger

    workload = SimpleNamespace(
        streams=SimpleNamespace(train=SimpleNamespace(windows=lambda window: 1 << 20)),
        model=SimpleNamespace(seq_len=64),
    )
    spec = PeerSpec.of(algorithm="diloco", inner_steps=3, batch_size=8)
    lowered = token_ledger(spec.changed(max_micro_batches=64), workload)
    default = token_ledger(spec, workload)
    assert spec.model.max_micro_batches == MOST_MICRO_BATCHES
    assert lowered.describe() == default.describe()
    lane = default.lane(0, 0, 1)
    lane.windows = 8 * MOST_MICRO_BATCHES * 3  # every step at the default cap
    lowered.record(0, {b"fast": lane.claim()})
    assert lowered.settle(0).credited == {b"fast": lane.windows}
