"""DeMo against an independent float64 re-computation of the reference, its options, its state."""

import functools
import struct
import time
from datetime import timedelta

import pytest
import torch

from shoal.compression import DCTTopKCodec
from shoal.peer.algorithms.demo import DeMo
from shoal.peer.algorithms.exchange import (
    Contribution,
    Delegating,
    Exchange,
    Gathered,
    LoopbackExchange,
    TorchDistributedExchange,
)
from shoal.peer.algorithms.exchange import run_loopback as run_workers
from shoal.peer.algorithms.robust import DEMO, NONE, Robustness
from shoal.peer.swarm.exchange import SwarmExchange
from shoal.protocol import Payload
from tests import demo_reference

SHAPES = [(128, 192), (96,), (48, 64), (5, 7)]


def make_grads(steps: int, workers: int, seed: int = 0) -> list[list[list[torch.Tensor]]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        [[torch.randn(s, generator=generator, dtype=torch.float64) for s in SHAPES] for _ in range(workers)]
        for _ in range(steps)
    ]


def train_workers(initial, grads, dtype=torch.float64, device="cpu", gather_limit=0, **demo_kwargs):
    """Every worker's final params (on `device`) and optimizer, each worker a loopback thread;
    unscreened (the reference semantics) unless `robust` says otherwise; `gather_limit` bounds the
    fan-in (`LoopbackExchange.group`)."""
    demo_kwargs.setdefault("robust", NONE)

    def work(rank, exchange):
        params = [torch.nn.Parameter(p.clone().to(device=device, dtype=dtype)) for p in initial]
        opt = DeMo(params, exchange=exchange, **demo_kwargs)
        for step_grads in grads:
            for p, g in zip(params, step_grads[rank], strict=True):
                p.grad = g.to(device=device, dtype=dtype)
            opt.step()
        return [p.detach() for p in params], opt

    return run_workers(len(grads[0]), work, gather_limit=gather_limit)


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_steps_equal_float64_reference_recomputation(workers):
    torch.manual_seed(10)
    initial = [torch.randn(s, dtype=torch.float64) for s in SHAPES]
    grads = make_grads(steps=4, workers=workers)
    expected = demo_reference.demo_steps(initial, grads, lr=1e-3, weight_decay=0.1)
    for params, _ in train_workers(initial, grads, lr=1e-3, weight_decay=0.1):
        for got, want in zip(params, expected, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize(("workers", "topk"), [(3, 4), (4, 8), (3, 11), (5, 32)])
def test_sparse_and_dense_combination_both_equal_the_reference(workers, topk):
    """k x workers <= 32 values per 64x64 chunk take the sparse inverse (duplicate indices across
    workers included), more take the dense one; both must give the reference's parameters."""
    torch.manual_seed(14)
    initial = [torch.randn(s, dtype=torch.float64) for s in SHAPES]
    grads = make_grads(steps=4, workers=workers, seed=2)
    expected = demo_reference.demo_steps(initial, grads, lr=1e-3, topk=topk)
    for params, _ in train_workers(initial, grads, lr=1e-3, compression_topk=topk):
        for got, want in zip(params, expected, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_float32_steps_match_the_reference_up_to_rare_sign_flips():
    torch.manual_seed(11)
    initial = [torch.randn(s, dtype=torch.float64) for s in SHAPES]
    grads = make_grads(steps=3, workers=2, seed=1)
    expected = demo_reference.demo_steps(initial, grads, lr=1e-3)
    params, _ = train_workers(initial, grads, dtype=torch.float32, lr=1e-3)[0]
    for got, want in zip(params, expected, strict=True):
        flipped = ((got.double() - want).abs() > 1e-5).float().mean().item()
        assert flipped < 1e-3  # fp32 vs fp64 only differs where the combined direction is ~0


def test_workers_hold_bit_identical_params_after_50_steps_with_quantized_values():
    torch.manual_seed(12)
    initial = [torch.randn(s) for s in SHAPES]
    grads = make_grads(steps=50, workers=4, seed=2)
    results = train_workers(
        initial,
        grads,
        dtype=torch.float32,
        lr=1e-3,
        compression_topk=4,
        value_bits=1,
        error_feedback=0.5,
        compression_decay=0.995,
    )
    first = results[0][0]
    for params, _ in results[1:]:
        for a, b in zip(params, first, strict=True):
            assert torch.equal(a, b)
    assert any(not torch.equal(a, torch.as_tensor(b).float()) for a, b in zip(first, initial, strict=True))


@pytest.mark.parametrize("bits", [16, 8, 4, 1])
def test_quantized_values_keep_two_workers_identical_and_steps_of_size_lr(bits):
    torch.manual_seed(15)
    initial = [torch.randn(s) for s in SHAPES]
    grads = make_grads(steps=3, workers=2, seed=3)
    results = train_workers(initial, grads, dtype=torch.float32, lr=1e-2, value_bits=bits, compression_topk=8)
    for a, b, start in zip(results[0][0], results[1][0], initial, strict=True):
        assert torch.equal(a, b)
        assert (a - start).abs().max().item() <= 3 * 1e-2 + 1e-6  # sign steps: at most lr per step


def test_error_feedback_fraction_leaves_the_rest_in_momentum():
    p = torch.nn.Parameter(torch.zeros(64, 64))
    p.grad = torch.randn(64, 64)
    opt = DeMo([p], lr=0.5, exchange=LoopbackExchange.group(1)[0], error_feedback=0.2, compression_topk=8)
    opt.step()
    accumulated = 0.5 * p.grad  # the momentum after one step, before anything is sent
    every = DCTTopKCodec(topk=64 * 64).select(accumulated)
    expected = torch.zeros(1, 64 * 64).scatter_(1, every.indices, every.values)  # kept in the DCT domain
    kept = DCTTopKCodec(topk=8).select(accumulated)
    expected.scatter_(1, kept.indices, kept.values * (1 - 0.2))
    torch.testing.assert_close(opt.state[p]["delta"], expected)


class _FixedExchange(Exchange):
    """Returns prepared contributions around this participant's own and keeps what it was sent;
    for unit tests only."""

    def __init__(self, others: list[Contribution], adopt: list[torch.Tensor] | None = None):
        self.others = others
        self.sent: list[bytes] = []
        self.adopt = adopt
        self.rejected: list[tuple[int, str]] = []

    rank = property(lambda self: 0)
    world_size = property(lambda self: 1 + len(self.others))

    def gather(self, payload: bytes, samples: int, state=None, plan=None) -> Gathered:
        self.sent.append(payload)
        return Gathered((Contribution(0, payload, samples), *self.others), adopted=self.adopt)

    def mean(self, tensor, weight=1.0):
        raise NotImplementedError

    def reject(self, contribution, reason):
        self.rejected.append((contribution.rank, reason))


def test_weighting_by_samples_weights_each_participants_coefficients():
    torch.manual_seed(13)
    other_grad = torch.randn(64)
    other = torch.nn.Parameter(torch.zeros(64))
    other.grad = other_grad
    # the other participant's payload, produced by a real DeMo step
    recorder = _FixedExchange([])
    DeMo([other], lr=1.0, exchange=recorder, compression_topk=64, compression_decay=0.0).step()

    mine = torch.nn.Parameter(torch.zeros(64))
    my_grad = torch.randn(64)
    mine.grad = my_grad
    opt = DeMo(
        [mine],
        lr=1.0,
        exchange=_FixedExchange([Contribution(1, recorder.sent[0], 3)]),
        compression_topk=64,
        compression_decay=0.0,
        weight_by_samples=True,
    )
    opt.step(samples=1)
    expected = -torch.sign((my_grad * 1 + other_grad * 3) / 4)
    torch.testing.assert_close(mine.detach(), expected, atol=1e-6, rtol=0)


def test_malformed_contributions_are_dropped_and_counted():
    p = torch.nn.Parameter(torch.zeros(64, 64))
    p.grad = torch.randn(64, 64)
    bad = [Contribution(1, b"\xff\xff", 1), Contribution(2, b"", 1), Contribution(3, b"x" * 100, 1)]
    exchange = _FixedExchange(bad)
    opt = DeMo([p], lr=0.1, exchange=exchange)
    opt.step()
    assert sum(opt.stats.rejected.values()) == 3
    assert [rank for rank, _ in exchange.rejected] == [1, 2, 3]  # the exchange may strike the senders
    assert torch.isfinite(p).all() and p.abs().max().item() == pytest.approx(0.1)


def test_huge_finite_values_from_a_peer_never_make_params_nan():
    p = torch.nn.Parameter(torch.zeros(64, 64))
    hostile = Payload.FromString(_payload_of(torch.ones(64, 64)))
    hostile.tensors[0].values = struct.pack("<f", 3.4e38) * (len(hostile.tensors[0].values) // 4)
    hostile.tensors[0].values_zstd = False
    others = [Contribution(r, hostile.SerializeToString(), 1) for r in (1, 2)]
    p.grad = torch.randn(64, 64)
    opt = DeMo([p], lr=0.1, exchange=_FixedExchange(others), compression_topk=32)
    opt.step()
    assert torch.isfinite(p).all()


def _payload_of(grad: torch.Tensor) -> bytes:
    recorder = _FixedExchange([])
    p = torch.nn.Parameter(torch.zeros_like(grad))
    p.grad = grad
    DeMo([p], lr=1.0, exchange=recorder, compression_topk=32, value_bits=32).step()
    return recorder.sent[0]


def test_state_dict_round_trip_continues_identically():
    torch.manual_seed(14)
    grads = [torch.randn(96, 64) for _ in range(6)]

    def fresh():
        p = torch.nn.Parameter(torch.ones(96, 64))
        return p, DeMo([p], lr=1e-2, exchange=LoopbackExchange.group(1)[0], compression_topk=4)

    p_ref, opt_ref = fresh()
    for g in grads:
        p_ref.grad = g
        opt_ref.step()
    p_a, opt_a = fresh()
    for g in grads[:3]:
        p_a.grad = g
        opt_a.step()
    saved = opt_a.state_dict()
    p_b, opt_b = fresh()
    with torch.no_grad():
        p_b.copy_(p_a)
    opt_b.load_state_dict(saved)
    for g in grads[3:]:
        p_b.grad = g
        opt_b.step()
    assert torch.equal(p_b, p_ref)


def test_state_is_one_parameter_sized_buffer():
    params = [torch.nn.Parameter(torch.zeros(s)) for s in SHAPES]
    for p in params:
        p.grad = torch.ones_like(p)
    opt = DeMo(params, lr=1e-3, exchange=LoopbackExchange.group(1)[0])
    opt.step()
    state = [v for entry in opt.state.values() for v in entry.values() if torch.is_tensor(v)]
    assert sum(t.numel() for t in state) == sum(p.numel() for p in params)
    assert all(t.dtype == torch.float32 for t in state)


def test_tensors_of_one_chunk_shape_travel_as_one_message():
    params = [torch.nn.Parameter(torch.zeros(s)) for s in [(128, 64), (64, 64), (64,), (128,), (5, 7)]]
    for p in params:
        p.grad = torch.randn_like(p)
    recorder = _FixedExchange([])
    DeMo(params, lr=1e-3, exchange=recorder).step()
    shapes = [list(t.chunk_shape) for t in Payload.FromString(recorder.sent[0]).tensors]
    assert sorted(shapes) == [[1, 64], [5, 7], [64, 64]]


def test_scalar_and_unused_parameters_take_part():
    scalar = torch.nn.Parameter(torch.tensor(2.0))
    unused = torch.nn.Parameter(torch.zeros(8))
    scalar.grad = torch.tensor(-1.0)
    opt = DeMo([scalar, unused], lr=0.5, exchange=LoopbackExchange.group(1)[0])
    opt.step()
    assert scalar.item() == pytest.approx(2.5) and torch.equal(unused, torch.zeros(8))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lr": 0}, "lr"),
        ({"compression_decay": 1.0}, "compression_decay"),
        ({"error_feedback": 1.5}, "error_feedback"),
        ({"weight_decay": -1}, "weight_decay"),
        ({"value_bits": 3}, "value_bits"),
        ({"compression_topk": 0}, "topk"),
        ({"lookahead": True}, "lookahead needs overlap"),
    ],
)
def test_bad_settings_name_the_setting(kwargs, match):
    settings = {"lr": 1e-3, **kwargs}
    with pytest.raises(ValueError, match=match):
        DeMo([torch.nn.Parameter(torch.zeros(4))], exchange=LoopbackExchange.group(1)[0], **settings)


def test_an_outsized_contribution_is_clipped_to_the_rounds_median_norm():
    torch.manual_seed(21)
    mine, honest, attack = torch.randn(64, 64), torch.randn(64, 64), torch.randn(64, 64)
    others = [Contribution(1, _payload_of(honest), 1), Contribution(2, _payload_of(attack * 1000), 1)]

    def update(norm_ratio):
        p = torch.nn.Parameter(torch.zeros(64, 64))
        p.grad = mine.clone()
        robust = Robustness(norm_ratio=norm_ratio, min_agreement=None)
        opt = DeMo([p], lr=1.0, exchange=_FixedExchange(others), compression_topk=32, robust=robust)
        opt.step()
        return p.detach(), opt.stats.clipped

    unclipped, count = update(None)
    assert count == 0
    assert update(4.0)[1] == 1
    clipped, count = update(1.0)  # the default bound
    assert count == 1
    attack_sign = -torch.sign(DeMo_direction(attack))
    # unbounded, the attacker decides every coefficient it sends; clipped, it is one voice among three
    assert (torch.sign(unclipped) == attack_sign).float().mean() > 0.95
    assert (torch.sign(clipped) == attack_sign).float().mean() < 0.8


def test_the_default_screening_is_the_exchanges_and_a_policy_given_wins():
    """Trusted participants (loopback, torch.distributed) get the reference semantics, the swarm (and a
    loopback standing for it) DeMo's screening; a wrapper is as trusted as the exchange it wraps."""
    params = [torch.nn.Parameter(torch.zeros(4))]
    trusted, untrusted = LoopbackExchange.group(1)[0], LoopbackExchange.group(1, trusted=False)[0]
    for exchange, expected in [
        (trusted, NONE),
        (untrusted, DEMO),
        (_FixedExchange([]), DEMO),  # an Exchange says nothing: untrusted
        (Delegating(trusted), NONE),
        (Delegating(untrusted), DEMO),
    ]:
        assert DeMo(params, lr=1e-3, exchange=exchange).robust is expected
    assert DeMo(params, lr=1e-3, exchange=trusted, robust=DEMO).robust is DEMO
    assert DeMo(params, lr=1e-3, exchange=untrusted, robust=NONE).robust is NONE
    assert TorchDistributedExchange.trusted and not SwarmExchange.trusted


def DeMo_direction(grad: torch.Tensor) -> torch.Tensor:
    """The update direction DeMo applies for this gradient alone."""
    p = torch.nn.Parameter(torch.zeros_like(grad))
    p.grad = grad
    DeMo([p], lr=1.0, exchange=_FixedExchange([]), compression_topk=32).step()
    return -p.detach()


def test_the_exchange_can_replace_the_parameters_before_the_update():
    p = torch.nn.Parameter(torch.zeros(8, 8))
    p.grad = torch.randn(8, 8)
    swarm = torch.full((8, 8), 5.0)
    opt = DeMo([p], lr=0.1, exchange=_FixedExchange([], adopt=[swarm]), compression_topk=4)
    opt.step()
    assert opt.stats.resyncs == 1
    assert torch.all((p - 5.0).abs() <= 0.1 + 1e-6) and not torch.equal(p.detach(), swarm)
    with pytest.raises(ValueError, match="does not match"):
        opt.load_shared_state([torch.zeros(3)])


class _OneRoundLate(Exchange):
    """Meets the others at once but hands back the previous round's contributions (none at first):
    a synchronous DeMo over it applies every aggregate one step late, the reference for overlap."""

    def __init__(self, inner: Exchange):
        self.inner = inner
        self.held = Gathered()

    rank = property(lambda self: self.inner.rank)
    world_size = property(lambda self: self.inner.world_size)

    def gather(self, payload: bytes, samples: int, state=None, plan=None) -> Gathered:
        previous, self.held = self.held, self.inner.gather(payload, samples, state=state, plan=plan)
        return previous

    def mean(self, tensor, weight=1.0):
        raise NotImplementedError

    def reject(self, contribution, reason):
        self.inner.reject(contribution, reason)


def test_overlap_applies_every_aggregate_one_step_late_and_finish_lands_everyone_together():
    torch.manual_seed(20)
    initial = [torch.randn(s, dtype=torch.float64) for s in SHAPES]
    grads = make_grads(steps=8, workers=3, seed=4)
    settings = {"lr": 1e-3, "weight_decay": 0.1, "compression_topk": 4, "value_bits": 1, "robust": NONE}

    def work(rank, exchange, overlap):
        params = [torch.nn.Parameter(p.clone()) for p in initial]
        opt = DeMo(
            params, exchange=exchange if overlap else _OneRoundLate(exchange), overlap=overlap, **settings
        )
        for step_grads in grads:
            for p, g in zip(params, step_grads[rank], strict=True):
                p.grad = g
            opt.step()
        before = [p.detach().clone() for p in params]
        opt.finish()
        opt.close()
        return before, [p.detach() for p in params]

    late = run_workers(3, lambda rank, exchange: work(rank, exchange, overlap=False))
    overlapped = run_workers(3, lambda rank, exchange: work(rank, exchange, overlap=True))
    for (before, after), (reference, _) in zip(overlapped, late, strict=True):
        for got, want in zip(before, reference, strict=True):
            assert torch.equal(got, want)  # the same arithmetic, in the same order
        assert any(not torch.equal(a, b) for a, b in zip(after, before, strict=True))  # the last round
        for a, b in zip(after, overlapped[0][1], strict=True):
            assert torch.equal(a, b)


def test_overlap_hides_a_slow_exchange_behind_the_next_steps_computation():
    latency = 0.3

    def work(rank, exchange, overlap):
        p = torch.nn.Parameter(torch.zeros(32, 32))
        opt = DeMo([p], lr=1e-3, exchange=exchange, compression_topk=4, overlap=overlap)
        for _ in range(5):
            time.sleep(latency)  # the forward and backward pass
            p.grad = torch.randn(32, 32)
            opt.step()
        opt.finish()
        opt.close()
        return opt

    waited = {}
    for overlap in (False, True):
        opts = run_workers(2, functools.partial(work, overlap=overlap), latency=timedelta(seconds=latency))
        waited[overlap] = opts[0]
    assert waited[False].stats.phase_seconds["exchange"] >= 5 * latency * 0.9  # every exchange waited for
    assert waited[True].stats.exchange_s >= 5 * latency * 0.9
    # overlapped: only the last round (collected by finish) and scheduling noise are waited for
    assert waited[True].stats.phase_seconds["exchange"] < 2 * latency


def test_overlap_adopts_the_swarms_parameters_before_the_late_update():
    p = torch.nn.Parameter(torch.zeros(8, 8))
    swarm = torch.full((8, 8), 5.0)
    opt = DeMo([p], lr=0.1, exchange=_FixedExchange([], adopt=[swarm]), compression_topk=4, overlap=True)
    p.grad = torch.randn(8, 8)
    opt.step()  # round 0 is in flight: nothing applied, nothing adopted yet
    assert opt.stats.resyncs == 0 and torch.equal(p.detach(), torch.zeros(8, 8))
    opt.finish()
    assert opt.stats.resyncs == 1
    assert torch.all((p - 5.0).abs() <= 0.1 + 1e-6) and not torch.equal(p.detach(), swarm)
    opt.close()


def test_lookahead_computes_gradients_ahead_and_keeps_the_shared_parameters_identical():
    torch.manual_seed(21)
    initial = [torch.randn(s) for s in SHAPES]
    grads = make_grads(steps=6, workers=3, seed=5)
    lr = 1e-2

    def work(rank, exchange):
        params = [torch.nn.Parameter(p.clone()) for p in initial]
        opt = DeMo(params, lr=lr, exchange=exchange, compression_topk=4, overlap=True, lookahead=True)
        for step_grads in grads:
            for p, g in zip(params, step_grads[rank], strict=True):
                p.grad = g.float()
            opt.step()
        live = [p.detach().clone() for p in params]
        shared = [t.clone() for t in opt.shared_state()]
        opt.unshift()
        assert all(torch.equal(p, t) for p, t in zip(params, shared, strict=True))  # exactly back
        opt.finish()
        opt.close()
        return live, shared, [p.detach() for p in params]

    results = run_workers(3, work)
    live0, shared0, final0 = results[0]
    for live, shared, final in results:
        assert all(torch.equal(a, b) for a, b in zip(shared, shared0, strict=True))
        assert all(torch.equal(a, b) for a, b in zip(final, final0, strict=True))
        for a, b in zip(live, shared, strict=True):
            assert (a - b).abs().max().item() <= lr * 1.0001  # one sign step of lr: the guess
    # each participant guesses from its own momentum: the live parameters differ between them
    assert any(not torch.equal(a, b) for a, b in zip(results[1][0], live0, strict=True))
    assert any(not torch.equal(a, b) for a, b in zip(live0, shared0, strict=True))
