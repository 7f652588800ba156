"""shoal.peer.algorithms.robust: the screening rules against hand-computed cases and against attackers that
send well-formed contributions; DeMo's config_mismatch."""

import math

import pytest
import torch

from shoal.compression import DCTTopKCodec, DenseCodec, decode_tensor
from shoal.peer.algorithms import demo, demo_receive
from shoal.peer.algorithms.demo import DeMo
from shoal.peer.algorithms.exchange import Contribution, Exchange, Gathered
from shoal.peer.algorithms.robust import (
    DILOCO,
    NONE,
    Reference,
    Robustness,
    Suspicion,
    add_screened_mean,
    agreements,
    capped_weights,
    screen,
)
from shoal.peer.bench.hostile import poison
from shoal.peer.swarm.ledger import content_digest
from shoal.protocol import Payload
from shoal.protocol.rules import BELIEVABLE_RATIO


def honest_and_attackers(honest: int, attackers: int, seed: int = 0, scale: float = 3.9):
    """Honest contributions share a direction plus noise; attackers send the negated mean, scaled."""
    generator = torch.Generator().manual_seed(seed)
    common = torch.randn(256, generator=generator)
    good = [[common + torch.randn(256, generator=generator)] for _ in range(honest)]
    bad = [[-scale * common] for _ in range(attackers)]
    return good, bad, common


def test_weights_are_capped_at_the_ratio_times_the_lower_median():
    assert capped_weights([16, 16, 16, 2**40], 2.0) == [16, 16, 16, 32]
    assert capped_weights([1, 100], 2.0) == [1, 2]  # lower median of two: the smaller
    assert capped_weights([5, 2**40], None) == [5, float(2**40)]


def test_agreement_is_the_median_pairwise_cosine():
    gram = [[1.0, 1.0, -1.0], [1.0, 1.0, -1.0], [-1.0, -1.0, 1.0]]
    assert agreements(gram) == [-1.0, -1.0, -1.0]  # lower median of (1, -1) each, (-1, -1)
    gram = [[4.0, 2.0, 0.0, 2.0], [2.0, 4.0, 0.0, 2.0], [0.0, 0.0, 0.0, 0.0], [2.0, 2.0, 0.0, 4.0]]
    cosines = agreements(gram)
    assert cosines[2] is None and all(math.isclose(c, 0.5) for c in cosines if c is not None)


@pytest.mark.parametrize(("honest", "attackers"), [(3, 1), (6, 2)])
def test_attackers_that_negate_the_mean_are_dropped_and_honest_ones_kept(honest, attackers):
    good, bad, common = honest_and_attackers(honest, attackers)
    samples = [16] * honest + [16 * BELIEVABLE_RATIO] * attackers  # the largest believable lie buys nothing
    mean = [torch.zeros(256)]
    _, verdict = add_screened_mean(mean, list(zip(good + bad, samples, strict=True)), DILOCO)
    assert verdict.reasons == [None] * honest + ["opposed"] * attackers
    assert torch.cosine_similarity(mean[0], common, dim=0) > 0.8
    unscreened = [torch.zeros(256)]
    add_screened_mean(unscreened, list(zip(good + bad, samples, strict=True)), NONE)
    assert torch.cosine_similarity(unscreened[0], common, dim=0) < -0.99  # what screening prevents


def test_an_outsized_contribution_is_bounded_by_the_median_norm():
    good, _, _ = honest_and_attackers(3, 0)
    huge = [good[0][0] * 1000]
    verdict = screen([*good, huge], [1, 1, 1, 1], Robustness(min_agreement=None, suspect_below=None))
    norms = sorted(t[0].norm().item() for t in [*good, huge])
    assert verdict.clipped == 2  # at ratio 1, whatever is above the lower median, the largest honest too
    assert math.isclose(verdict.factors[3] * huge[0].norm().item(), norms[1], rel_tol=1e-5)


def test_suspicion_reports_a_sender_whose_recent_agreement_is_negative_and_forgets_the_oldest():
    suspicion = Suspicion(Robustness(suspect_window=4, suspect_after=2), max_senders=2)
    assert suspicion.outliers([b"a", b"b"], [-0.05, 0.04]) == [False, False]  # too few rounds yet
    assert suspicion.outliers([b"a", b"b"], [-0.02, -0.01]) == [True, False]
    assert suspicion.outliers([b"a", b"b"], [0.3, None]) == [False, False]  # mean recovers
    suspicion.outliers([b"c"], [0.1])  # a third sender pushes out the oldest
    assert set(suspicion._recent) == {b"b", b"c"}


def test_suspicion_reports_a_sender_of_noise_that_agrees_with_nobody_and_only_it():
    suspicion = Suspicion(Robustness(suspect_window=4, suspect_after=2))
    senders = [b"a", b"b", b"c", b"noise"]
    verdicts = [suspicion.outliers(senders, [0.05, 0.04, 0.06, 0.002]) for _ in range(3)]
    assert verdicts[0] == [False] * 4  # too few rounds yet
    assert verdicts[1] == verdicts[2] == [False, False, False, True]  # 0.002 < 0.15 * 0.05
    # the honest ones may agree little, late in training: no one is reported for the round's level
    quiet = Suspicion(Robustness(suspect_window=4, suspect_after=2))
    for _ in range(3):
        assert quiet.outliers(senders[:3], [0.003, 0.002, 0.004]) == [False] * 3
    unbounded = Suspicion(Robustness(suspect_window=4, suspect_after=2, suspect_relative=None))
    assert [unbounded.outliers(senders, [0.05, 0.04, 0.06, 0.002]) for _ in range(2)][1] == [False] * 4


@pytest.mark.parametrize(
    "kwargs",
    [
        {"norm_ratio": 0.5},
        {"suspect_relative": 1.0},
        {"sample_ratio": 0.9},
        {"min_agreement": 1.0},
        {"min_screened": 2},
        {"suspect_after": 9},
    ],
)
def test_bad_settings_name_the_setting(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        Robustness(**kwargs)


class _Fixed(Exchange):
    """This participant plus fixed contributions from others; records what the optimizer rejects."""

    def __init__(self, others: list[Contribution]):
        self.others, self.rejected = others, []

    rank = property(lambda self: 0)
    world_size = property(lambda self: 1 + len(self.others))

    def gather(self, payload, samples, state=None, plan=None):
        return Gathered((Contribution(0, payload, samples, b"me"), *self.others))

    def mean(self, tensor, weight=1.0):
        raise NotImplementedError

    def reject(self, contribution, reason):
        self.rejected.append((contribution.sender, reason))


@pytest.mark.parametrize(("chunk", "topk", "bits"), [(64, 8, 32), (64, 4, 8), (32, 4, 32)])
def test_demo_rejects_a_payload_sent_with_other_topk_value_bits_or_chunk(chunk, topk, bits):
    codec = DCTTopKCodec(chunk=chunk, topk=topk, value_bits=bits)
    foreign = Payload(tensors=[codec.pack(codec.select(torch.randn(64, 64)), torch.float32)])
    exchange = _Fixed([Contribution(1, foreign.SerializeToString(), 1, b"other")])
    p = torch.nn.Parameter(torch.zeros(64, 64))
    p.grad = torch.randn(64, 64)
    opt = DeMo([p], lr=1e-3, exchange=exchange, compression_topk=4, value_bits=32)
    opt.step()
    assert exchange.rejected == [(b"other", "config_mismatch")]
    assert opt.stats.rejected["config_mismatch"] == 1


def test_demo_screens_with_the_gram_matrix_of_the_dense_coefficients(monkeypatch):
    codec = DCTTopKCodec(chunk=32, topk=4, value_bits=32)
    shapes = [(64, 96), (64, 96), (32, 32)]  # one slice: DeMo views them all as (416, 32)
    generator = torch.Generator().manual_seed(0)
    common = torch.randn(416, 32, generator=generator)  # so that the others' top-k overlap
    others = [
        Contribution(
            rank,
            Payload(
                tensors=[codec.encode(common + 0.3 * torch.randn(416, 32, generator=generator))]
            ).SerializeToString(),
            1,
            bytes([rank]),
        )
        for rank in (1, 2, 3)
    ]
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator)
    seen = {}
    original_screen, original_judged = demo_receive.screen, demo_receive.judged

    def screen(decoded, *args, **kwargs):
        seen["decoded"] = decoded
        return original_screen(decoded, *args, **kwargs)

    def judged(gram, *args):
        seen["gram"] = gram
        return original_judged(gram, *args)

    monkeypatch.setattr(demo, "screen", screen)
    monkeypatch.setattr(demo_receive, "judged", judged)
    DeMo(
        params, lr=1e-3, exchange=_Fixed(others), compression_topk=4, value_bits=32, compression_chunk=32
    ).step()
    dense = []
    for coeffs in seen["decoded"]:
        parts = []
        for c in coeffs:
            tiles = torch.zeros(c.plan.num_chunks, c.plan.chunk_numel)
            parts.append(tiles.scatter_(1, c.indices, c.values.float()).flatten())
        dense.append(torch.cat(parts))
    expected = torch.stack(dense) @ torch.stack(dense).T
    assert len(seen["decoded"]) == 4 and seen["decoded"][0][0].plan.num_chunks == 13
    assert torch.allclose(torch.tensor(seen["gram"]), expected, rtol=1e-5, atol=1e-6)
    assert (expected - torch.diag(expected.diag())).abs().sum() > 0  # the contributions do overlap


def test_a_replay_is_known_by_content_whatever_bytes_are_appended():
    payload = Payload(tensors=[DCTTopKCodec(topk=4).encode(torch.randn(64, 64))]).SerializeToString()
    unknown_field = b"\xf8\x07\x01"  # field 127, varint 1: not in payload.proto
    assert content_digest(payload + unknown_field) == content_digest(payload) is not None
    assert content_digest(b"\x00" * 8 + b"not a payload") is None  # a mean's part: nothing to compare


def test_a_round_of_two_is_judged_against_the_own_update():
    """With two contributions the median rule cannot judge (each opposes the other); every honest
    participant has its own update, and a contribution pointing away from it is opposed."""
    good, bad, common = honest_and_attackers(2, 1)
    own = good[1]
    pairs = [(good[0], 16), (bad[0], 16)]
    mean = [torch.zeros(256)]
    _, verdict = add_screened_mean(mean, pairs, DILOCO, reference=Reference(own))
    assert verdict.reasons == [None, "opposed"]
    assert torch.cosine_similarity(mean[0], common, dim=0) > 0.5
    # its own contribution among them: the reference votes for it (their cosine is 1), the tie goes for
    _, verdict = add_screened_mean(
        [torch.zeros(256)], [(own, 16), (bad[0], 16)], DILOCO, reference=Reference(own)
    )
    assert math.isclose(verdict.cosines[0], 1.0, rel_tol=1e-5) and verdict.reasons == [None, "opposed"]
    # two attackers chosen together agree with each other: the reference alone judges them
    _, verdict = add_screened_mean(
        [torch.zeros(256)], [(bad[0], 16), ([bad[0][0] * 2], 16)], DILOCO, reference=Reference(own)
    )
    assert verdict.reasons == ["opposed", "opposed"]
    # without a reference, as before: nothing judged
    _, verdict = add_screened_mean([torch.zeros(256)], pairs, DILOCO)
    assert verdict.reasons == [None, None]


def test_the_own_update_breaks_the_tie_of_a_round_half_hostile():
    """`--gather 4` with 2 attackers of 8 chooses both in some rounds: 2 of 4. By the median of the
    others alone every honest contribution then has two negative cosines of three, and is opposed;
    with the own update's vote (the upper median of four), only the attackers are."""
    good, bad, _ = honest_and_attackers(3, 2)
    pairs = [(good[0], 16), (good[1], 16), (bad[0], 16), (bad[1], 16)]
    _, alone = add_screened_mean([torch.zeros(256)], pairs, DILOCO)
    assert alone.reasons == ["opposed"] * 4  # what honest peers struck each other for
    _, verdict = add_screened_mean([torch.zeros(256)], pairs, DILOCO, reference=Reference(good[2]))
    assert verdict.reasons == [None, None, "opposed", "opposed"]


def test_suspicion_keeps_its_record_across_rounds_of_two():
    """DeMo and sparse DiLoCo drop nothing per round; under `--gather 2` the cosine with the own update
    still enters each sender's record, so a persistent opposer is an outlier from its third round
    (the optimizers pass their own update only under a fan-in: a swarm of two judges as before)."""
    good, bad, _ = honest_and_attackers(4, 1)
    suspicion = Suspicion(demo_policy := Robustness(min_agreement=None))
    verdicts = []
    for number in range(4):
        pairs = [(good[number % 3], 16), (bad[0], 16)]
        senders = [b"honest%d" % (number % 3), b"attacker"]
        _, verdict = add_screened_mean(
            [torch.zeros(256)], pairs, demo_policy, suspicion, senders, Reference(good[3])
        )
        verdicts.append(verdict.reasons)
    assert verdicts[:2] == [[None, None]] * 2 and verdicts[2:] == [[None, "outlier"]] * 2


def test_known_outliers_do_not_vote_on_honest_contributions_in_the_rounds_they_share():
    """`--gather 4`, 2 attackers of 8, DeMo (suspicion only, no reference in its record): in a round
    that chooses both attackers, an honest contribution's three votes are two attackers and one honest
    peer. Once the attackers are outliers by their earlier rounds, they no longer vote: the honest
    contributions are judged by each other, and none of them becomes an outlier."""
    generator = torch.Generator().manual_seed(1)
    common = torch.randn(256, generator=generator)
    honest = [[0.3 * common + torch.randn(256, generator=generator)] for _ in range(6)]
    attackers = [[-3.0 * common + torch.randn(256, generator=generator)] for _ in range(2)]
    names = [b"h%d" % i for i in range(6)] + [b"a0", b"a1"]
    policy = Robustness(min_agreement=None)

    def shared_rounds(by_votes: bool) -> list[dict[bytes, str | None]]:
        suspicion, verdicts = Suspicion(policy), []
        for number in range(8):  # honest 2n and 2n+1 with both attackers, then the other four
            pair = [2 * (number % 3), 2 * (number % 3) + 1]
            for chosen in ([*pair, 6, 7], [i for i in range(6) if i not in pair]):
                pairs = [(([*honest, *attackers])[i], 16) for i in chosen]
                senders = [names[i] for i in chosen]
                if by_votes:
                    _, verdict = add_screened_mean([torch.zeros(256)], pairs, policy, suspicion, senders)
                    reasons = verdict.reasons
                else:  # as before: each round's median of every vote, kept as it was
                    cosines = screen([t for t, _ in pairs], [16] * 4, policy).cosines
                    reasons = ["outlier" if out else None for out in suspicion.outliers(senders, cosines)]
                verdicts.append(dict(zip(senders, reasons, strict=True)))
        return verdicts

    def honest_reports(verdicts):
        return [v for round_ in verdicts for sender, v in round_.items() if sender[:1] == b"h" and v]

    verdicts = shared_rounds(by_votes=True)
    attacker_reports = [round_[b"a0"] for round_ in verdicts if b"a0" in round_]
    assert honest_reports(verdicts) == [] and attacker_reports[2:] == ["outlier"] * 6
    assert len(honest_reports(shared_rounds(by_votes=False))) >= 4  # what the votes' record prevents


def test_an_empty_contribution_weighs_nothing_and_does_not_lower_the_norm_bound():
    good, _, _ = honest_and_attackers(2, 0)
    zero = [torch.zeros(256)]
    mean = [torch.zeros(256)]
    total, verdict = add_screened_mean(mean, [(good[0], 16), (zero, 16)], DILOCO)
    assert total == 16 and verdict.weights == [16, 0.0] and verdict.clipped == 0
    torch.testing.assert_close(mean[0], good[0][0])


def test_a_claim_beyond_belief_is_left_out_whatever_its_direction():
    good, _, _ = honest_and_attackers(4, 0)
    samples = [16, 16, 16 * BELIEVABLE_RATIO, 16 * BELIEVABLE_RATIO + 1]
    _, verdict = add_screened_mean([torch.zeros(256)], list(zip(good, samples, strict=True)), DILOCO)
    assert verdict.reasons == [None, None, None, "overclaim"]
    assert verdict.weights == [16, 16, 32, 0.0]  # the believable one at the capped weight
    # a round of two: the smaller claim is the median
    _, verdict = add_screened_mean([torch.zeros(256)], [(good[0], 16), (good[1], 2**40)], DILOCO)
    assert verdict.reasons == [None, "overclaim"]


@pytest.mark.parametrize("codec", [DenseCodec(value_bits=32, zstd=False), DCTTopKCodec(chunk=16, topk=4)])
def test_a_little_is_enough_adds_the_own_norm_along_one_fixed_direction(codec):
    """`shoal bench hostile --attacks alie`: the poisoned update stays near cosine 1/sqrt(2) with the own
    one, inside the honest spread, and its extra part points the same way in every round."""
    generator = torch.Generator().manual_seed(4)
    shifts = []
    for _ in range(2):  # two rounds, two different own updates
        own = torch.randn(32, 32, generator=generator)
        if isinstance(codec, DCTTopKCodec):
            payload = Payload(tensors=[codec.pack(codec.select(own), torch.float32)]).SerializeToString()
        else:
            payload = Payload(tensors=[codec.encode(own)]).SerializeToString()
        sent, poisoned = (
            decode_tensor(Payload.FromString(p).tensors[0]).reshape(-1)
            for p in (payload, poison(payload, "alie", generator))
        )
        cosine = torch.cosine_similarity(sent, poisoned, dim=0).item()
        assert 0.4 < cosine < 0.9, cosine  # 1/sqrt(2) for an orthogonal direction, unquantized
        shifts.append(poisoned - sent)
    if isinstance(codec, DenseCodec):  # top-k reads the direction at other coefficients each round
        assert torch.cosine_similarity(shifts[0], shifts[1], dim=0) > 0.999
