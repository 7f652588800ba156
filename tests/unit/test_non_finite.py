"""No round kills a peer (issue 47): a round that counts nothing leaves the model as it was, a division
by a count of zero is guarded, and a non-finite update (this participant's own, or a round's mean) is
refused and counted, never applied nor encoded. In-process workers (LoopbackExchange, untrusted: they
screen as swarm peers do) stand for the participants; tests/integration/test_hostile.py runs the same
through real `shoal join` processes."""

import math

import pytest
import torch

from shoal.peer.algorithms.demo import DeMo
from shoal.peer.algorithms.diloco import DiLoCo
from shoal.peer.algorithms.exchange import Exchange, Gathered, LoopbackExchange, run_loopback
from shoal.peer.algorithms.robust import finite

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


class _NothingCounts(Exchange):
    """A round in which no payload counts and nobody is known to take part (world size 0), as a peer
    whose every chosen payload vanished saw it; for unit tests only."""

    rank = property(lambda self: 0)
    world_size = property(lambda self: 0)

    def __init__(self):
        self.refused: list[str] = []

    def gather(self, payload, samples, state=None, plan=None) -> Gathered:
        return Gathered()

    def refuse(self, reason: str) -> None:
        self.refused.append(reason)

    def mean(self, tensor, weight=1.0):
        raise NotImplementedError


torch.manual_seed(0)
_INITIAL = torch.nn.Linear(8, 4).state_dict()


def _model() -> torch.nn.Module:
    model = torch.nn.Linear(8, 4)
    model.load_state_dict(_INITIAL)  # every worker alike (the global seed is shared by the threads)
    return model


def _train(diloco: DiLoCo, model: torch.nn.Module, steps: int, poison_at: int | None = None) -> None:
    generator = torch.Generator().manual_seed(1)
    for step in range(steps):
        model(torch.randn(16, 8, generator=generator)).pow(2).mean().backward()
        diloco.step(samples=16)
        if step == poison_at:  # the inner phase diverges
            with torch.no_grad():
                model.weight.fill_(math.inf)


@pytest.mark.parametrize("mode", ["standard", "delayed", "eager"])
def test_diloco_rounds_that_count_nothing_neither_crash_nor_move_the_consensus(mode):
    model = _model()
    initial = [p.detach().clone() for p in model.parameters()]
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    with DiLoCo(model, inner, exchange=_NothingCounts(), inner_steps=2, mode=mode) as diloco:
        _train(diloco, model, 8)
        diloco.finish()
        for p, before in zip(diloco.consensus_params, initial, strict=True):
            assert torch.equal(p, before)  # the outer momentum did not move it either
        assert all(torch.isfinite(p).all() for p in model.parameters())
        if mode != "eager":  # eager applies its own share at once, as the paper's rule says
            assert all(torch.equal(p, b) for p, b in zip(model.parameters(), initial, strict=True))


@pytest.mark.parametrize("mode", ["standard", "eager"])
def test_a_diverged_inner_phase_is_refused_and_the_peers_stay_identical(mode):
    def work(rank: int, exchange: LoopbackExchange):
        model = _model()
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
        with DiLoCo(model, inner, exchange=exchange, inner_steps=2, mode=mode) as diloco:
            _train(diloco, model, 8, poison_at=4 if rank == 1 else None)
            diloco.finish()
            return [p.detach().clone() for p in model.parameters()], diloco.stats.refused

    (params0, refused0), (params1, refused1) = run_loopback(2, work, trusted=False)
    assert refused1 == {"own_non_finite": 1} and not refused0
    assert all(torch.isfinite(p).all() for p in params0)
    assert all(torch.equal(a, b) for a, b in zip(params0, params1, strict=True))


def test_diloco_never_applies_a_mean_that_overflowed():
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    exchange = _NothingCounts()
    with DiLoCo(model, inner, exchange=exchange, inner_steps=1) as diloco:
        before = [p.detach().clone() for p in diloco.global_params]
        diloco._apply([torch.full_like(p, math.inf) for p in diloco.global_params])
        assert exchange.refused == ["aggregate_non_finite"]
        assert diloco.stats.refused == {"aggregate_non_finite": 1}
        assert all(torch.equal(p, b) for p, b in zip(diloco.global_params, before, strict=True))
        # finite, but the outer step would overflow (the Nesterov direction, 1.9 x 3e38): refused whole
        diloco._apply([torch.full_like(p, 3e38) for p in diloco.global_params])
        assert diloco.stats.refused == {"aggregate_non_finite": 2}
        assert all(torch.equal(p, b) for p, b in zip(diloco.global_params, before, strict=True))
        assert all(not s for s in diloco.outer_optimizer.state.values())  # no momentum taken either


@pytest.mark.parametrize("overlap", [False, True])
def test_demo_refuses_a_non_finite_gradient_and_stays_in_step(overlap):
    generator = torch.Generator().manual_seed(2)
    grads = [[torch.randn(32, 48, generator=generator) for _ in range(2)] for _ in range(5)]
    grads[2][1] = torch.full((32, 48), math.nan)

    def work(rank: int, exchange: LoopbackExchange):
        param = torch.nn.Parameter(torch.zeros(32, 48))
        optimizer = DeMo([param], lr=0.01, exchange=exchange, compression_topk=4, overlap=overlap)
        for step in grads:
            param.grad = step[rank].clone()
            optimizer.step(samples=8)
        optimizer.finish()
        optimizer.close()
        delta = optimizer.state[param]["delta"]
        return param.detach(), optimizer.stats.refused, bool(torch.isfinite(delta).all())

    (p0, refused0, finite0), (p1, refused1, finite1) = run_loopback(2, work, trusted=False)
    assert refused1 == {"own_non_finite": 1} and not refused0
    assert finite0 and finite1 and torch.isfinite(p0).all() and torch.equal(p0, p1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("bad", "expected"),
    [(None, True), (math.nan, False), (math.inf, False), (-math.inf, False), (3e38, True)],
    ids=["clean", "nan", "inf", "-inf", "huge-finite"],
)
def test_finite_finds_any_non_finite_value_in_any_tensor_of_any_float_dtype(device, bad, expected):
    """One check over all the gradients (each device's own way: robust.finite): a single bad value in
    the last of several tensors of mixed dtypes is found; values that would overflow a sum are not bad;
    empty and integer tensors are skipped."""
    tensors = [
        torch.zeros(0, device=device),
        torch.arange(4, device=device),
        torch.randn(3, 5, device=device).bfloat16(),
        torch.randn(7, 9, device=device).t(),  # not contiguous
        torch.full((4097,), 3e38, device=device),  # sums to inf, yet finite
    ]
    if bad is not None:
        tensors[3][4, 2] = bad
    assert finite(tensors) is expected
    assert finite([]) is True
