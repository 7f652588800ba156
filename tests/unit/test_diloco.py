"""DiLoCo: reductions to AdamW and to standard mode, agreement, the eager formula, overlap, codecs."""

from datetime import timedelta

import pytest
import torch

from shoal.compression import DCTTopKCodec, DenseCodec, TopKCodec
from shoal.peer.algorithms.configs import DiLoCoConfig
from shoal.peer.algorithms.diloco import DiLoCo
from shoal.peer.algorithms.exchange import LoopbackExchange
from shoal.peer.algorithms.exchange import run_loopback as run_workers
from shoal.peer.algorithms.feedback import codec_for
from shoal.peer.algorithms.robust import DILOCO, DILOCO_SPARSE, NONE, Robustness
from shoal.peer.models.gpt import GPTConfig, TinyGPT

CONFIG = GPTConfig.preset("tiny", n_layer=1, d_model=32, seq_len=16)


def batches(rank: int, steps: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + rank)
    return [torch.randint(0, 256, (4, CONFIG.seq_len + 1), generator=generator) for _ in range(steps)]


torch.manual_seed(0)
INITIAL = TinyGPT(CONFIG).state_dict()


def make_model() -> TinyGPT:
    """The same initial model every time, also on worker threads (which share torch's global RNG)."""
    model = TinyGPT(CONFIG)
    model.load_state_dict(INITIAL)
    return model


def adamw(model: TinyGPT) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95))


def train(model, diloco, data):
    for tokens in data:
        model(tokens[:, :-1], targets=tokens[:, 1:]).backward()
        diloco.step(samples=tokens.shape[0])
    return [p.detach().clone() for p in model.parameters()]


def test_one_worker_outer_lr_1_no_momentum_equals_plain_adamw():
    data = batches(0, 12)
    reference = make_model()
    optimizer = adamw(reference)
    for tokens in data:
        reference(tokens[:, :-1], targets=tokens[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad()
    model = make_model()
    with DiLoCo(
        model,
        adamw(model),
        exchange=LoopbackExchange.group(1)[0],
        inner_steps=4,
        outer_lr=1.0,
        outer_momentum=0.0,
    ) as diloco:
        params = train(model, diloco, data)
    assert diloco.stats.outer_steps == 3
    for got, want in zip(params, reference.parameters(), strict=True):
        # theta - (theta - theta_m) is theta_m up to one rounding of the subtraction
        torch.testing.assert_close(got, want.detach(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("codec", [None, DenseCodec(8), DCTTopKCodec(topk=16, value_bits=8)])
def test_standard_mode_workers_hold_identical_params_after_each_outer_step(codec):
    def work(rank, exchange):
        model = make_model()
        with DiLoCo(
            model, adamw(model), exchange=exchange, robust=NONE, inner_steps=5, codec=codec
        ) as diloco:
            return train(model, diloco, batches(rank, 15)), diloco.stats

    results = run_workers(3, work)
    for params, _ in results[1:]:
        for a, b in zip(params, results[0][0], strict=True):
            assert torch.equal(a, b)
    initial = list(make_model().parameters())
    assert any(not torch.equal(a, b.detach()) for a, b in zip(results[0][0], initial, strict=True))
    assert all(stats.outer_steps == 3 and stats.bytes_sent > 0 for _, stats in results)


@pytest.mark.parametrize("codec", [None, DenseCodec(4)])
def test_eager_with_one_worker_and_instant_exchange_equals_standard(codec):
    runs = {}
    for mode in ("standard", "eager"):
        model = make_model()
        exchange = LoopbackExchange.group(1)[0]
        with DiLoCo(
            model,
            adamw(model),
            exchange=exchange,
            robust=NONE,
            inner_steps=3,
            mode=mode,
            codec=codec,
            outer_momentum=0.9,
        ) as diloco:
            runs[mode] = train(model, diloco, batches(0, 12))
    for a, b in zip(runs["standard"], runs["eager"], strict=True):
        assert torch.equal(a, b)


def test_the_late_modes_default_to_no_outer_momentum_and_standard_to_diloco_s():
    for mode, momentum, nesterov in (("standard", 0.9, True), ("delayed", 0.0, False), ("eager", 0.0, False)):
        model = make_model()
        with DiLoCo(
            model, adamw(model), exchange=LoopbackExchange.group(1)[0], inner_steps=2, mode=mode
        ) as d:
            for optimizer in (d.outer_optimizer, d.consensus_optimizer):
                assert (
                    optimizer.defaults["momentum"] == momentum and optimizer.defaults["nesterov"] is nesterov
                )
        with DiLoCo(
            model,
            adamw(model),
            exchange=LoopbackExchange.group(1)[0],
            inner_steps=2,
            mode=mode,
            outer_momentum=0.5,
        ) as d:
            assert d.outer_optimizer.defaults["momentum"] == 0.5


def test_delayed_mode_applies_the_previous_rounds_mean():
    model = make_model()
    start = [p.detach().clone() for p in model.parameters()]
    diloco = DiLoCo(
        model,
        adamw(model),
        exchange=LoopbackExchange.group(1)[0],
        inner_steps=2,
        mode="delayed",
        outer_lr=1.0,
        outer_momentum=0.0,
    )
    train(model, diloco, batches(0, 2))
    # round 1: nothing has arrived yet, so everyone restarts from the unchanged global params
    for p, s in zip(model.parameters(), start, strict=True):
        assert torch.equal(p.detach(), s)
    round_one = diloco._in_flight.peek().mean
    train(model, diloco, batches(1, 2))
    for p, s, d in zip(model.parameters(), start, round_one, strict=True):
        torch.testing.assert_close(p.detach(), s - d, rtol=0, atol=1e-7)  # theta(2) = theta(1) - delta(1)
    diloco.close()


@pytest.mark.parametrize("mode", ["delayed", "eager"])
def test_finish_applies_the_last_round_so_one_worker_ends_like_standard(mode):
    ends = {}
    for run_mode in ("standard", mode):
        model = make_model()
        with DiLoCo(
            model,
            adamw(model),
            exchange=LoopbackExchange.group(1)[0],
            inner_steps=3,
            mode=run_mode,
            outer_lr=1.0,
            outer_momentum=0.0,
        ) as diloco:
            train(
                model, diloco, batches(0, 3)
            )  # one round: standard applied it, the others have it in flight
            diloco.finish()
        ends[run_mode] = [p.detach().clone() for p in model.parameters()]
    for a, b in zip(ends["standard"], ends[mode], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)


def test_eager_direction_replaces_the_stale_own_share_by_the_fresh_one():
    """Two workers, equal samples: delta~_m(t) = delta(t-1) + (delta_m(t) - delta_m(t-1)) / 2."""

    def work(rank, exchange):
        model = make_model()
        diloco = DiLoCo(
            model,
            adamw(model),
            exchange=exchange,
            robust=NONE,
            inner_steps=2,
            mode="eager",
            outer_lr=1.0,
            outer_momentum=0.0,
        )
        snapshots = []
        outer_step = diloco.outer_step

        def recorded_outer_step(plan=None):  # theta before, own pseudo-gradient, theta after
            before = [g.clone() for g in diloco.global_params]
            own = [b - p.detach() for b, p in zip(before, diloco.params, strict=True)]
            outer_step(plan)
            snapshots.append((before, own, [g.clone() for g in diloco.global_params]))

        diloco.outer_step = recorded_outer_step
        train(model, diloco, batches(rank, 6))
        diloco.close()
        return snapshots

    histories = run_workers(2, work)
    for rank in (0, 1):
        (_, own1, after1), (before2, own2, after2), _ = histories[rank]
        # round 1: only the own fresh share, 1/M of it
        for b, o, a in zip(histories[rank][0][0], own1, after1, strict=True):
            torch.testing.assert_close(a, b - o / 2, rtol=0, atol=1e-6)
        # round 2: the true round-1 mean, own stale share swapped for the fresh one
        mean1 = [(x + y) / 2 for x, y in zip(histories[0][0][1], histories[1][0][1], strict=True)]
        for b, m, o1, o2, a in zip(before2, mean1, own1, own2, after2, strict=True):
            torch.testing.assert_close(a, b - (m - o1 / 2 + o2 / 2), rtol=0, atol=1e-6)


def eager_histories(workers: int, robust: Robustness) -> list[list]:
    """Every worker's (theta before, own pseudo-gradient, theta after) per outer step, 3 of 2 inner
    steps, eager mode, outer SGD lr 1 without momentum; and each outer step's round result."""

    def work(rank, exchange):
        model = make_model()
        settings = {"inner_steps": 2, "mode": "eager", "outer_lr": 1.0, "outer_momentum": 0.0}
        diloco = DiLoCo(model, adamw(model), exchange=exchange, robust=robust, **settings)
        snapshots, results = [], []
        outer_step, collect = diloco.outer_step, diloco._collect_pending

        def recorded_outer_step(plan=None):
            before = [g.clone() for g in diloco.global_params]
            own = [b - p.detach() for b, p in zip(before, diloco.params, strict=True)]
            outer_step(plan)
            snapshots.append((before, own, [g.clone() for g in diloco.global_params]))

        def recorded_collect():
            result = collect()
            results.append(result)
            return result

        diloco.outer_step, diloco._collect_pending = recorded_outer_step, recorded_collect
        train(model, diloco, batches(rank, 6))
        diloco.close()
        return snapshots, results

    return run_workers(workers, work)


def test_eager_subtracts_only_the_share_the_mean_gave_its_own_payload():
    """Norm bound at the median: of two workers, the larger pseudo-gradient is clipped, so its share
    of the mean is less than samples / total; its eager step removes exactly what the mean held."""
    (snaps0, results0), (snaps1, _) = eager_histories(2, Robustness(min_agreement=None, suspect_below=None))
    previous = results0[1]  # round 1's result, collected in outer step 2
    assert previous is not None and previous.total_samples > 0
    (_, own1, _), (before2, own2, after2) = snaps0[0], snaps0[1]
    norms = [sum(float(d.float().norm() ** 2) for d in snaps[0][1]) ** 0.5 for snaps in (snaps0, snaps1)]
    clipped = norms[0] > norms[1]
    share = previous.own_share
    assert share == pytest.approx(min(1.0, norms[1] / norms[0]) / 2 if clipped else 0.5, rel=1e-5)
    for b, m, o1, o2, a in zip(before2, previous.mean, own1, own2, after2, strict=True):
        torch.testing.assert_close(a, b - (m - share * o1 + o2 / 2), rtol=0, atol=1e-6)


def test_eager_after_a_round_that_accepted_nothing_steps_on_its_own_share():
    """A per-round drop that no payload passes (agreement 0.99) leaves every one out, as DILOCO's does
    for top-k payloads of random data: each eager step then takes the fresh pseudo-gradient over M, as
    in round 1, instead of dividing by a total of 0."""
    histories = eager_histories(3, Robustness(min_agreement=0.99))
    for snapshots, results in histories:
        assert [r.total_samples for r in results if r is not None] == [0.0, 0.0]
        for before, own, after in snapshots:
            for b, o, a in zip(before, own, after, strict=True):
                torch.testing.assert_close(a, b - o / 3, rtol=0, atol=1e-6)


def test_among_untrusted_participants_a_top_k_codec_defaults_to_screening_without_a_per_round_drop():
    model = make_model()
    exchange = LoopbackExchange.group(1, trusted=False)[0]  # as the swarm's
    assert DiLoCo(model, adamw(model), exchange=exchange, inner_steps=2).suspicion.policy is DILOCO
    sparse = DiLoCo(model, adamw(model), exchange=exchange, inner_steps=2, codec=TopKCodec())
    assert sparse.suspicion.policy is DILOCO_SPARSE and sparse.suspicion.policy.min_agreement is None


@pytest.mark.parametrize("codec", [None, TopKCodec()])
def test_trusted_participants_default_to_the_reference_semantics_and_an_explicit_policy_wins(codec):
    """Over a trusted exchange (loopback, torch.distributed) nothing is screened unless asked."""
    model = make_model()
    exchange = LoopbackExchange.group(1)[0]
    assert DiLoCo(model, adamw(model), exchange=exchange, inner_steps=2, codec=codec).suspicion.policy is NONE
    asked = DiLoCo(model, adamw(model), exchange=exchange, inner_steps=2, codec=codec, robust=DILOCO)
    assert asked.suspicion.policy is DILOCO


@pytest.mark.parametrize("mode", ["standard", "delayed", "eager"])
def test_every_mode_shares_one_state_and_ends_bit_identical(mode):
    """The shared state (consensus parameters and outer momentum) is the same on every worker after
    every outer step, eager mode included, and finish() puts every model on it."""

    def work(rank, exchange):
        model = make_model()
        states = []
        with DiLoCo(
            model, adamw(model), exchange=exchange, robust=NONE, inner_steps=3, mode=mode, outer_momentum=0.9
        ) as diloco:
            for step, tokens in enumerate(batches(rank, 12)):
                model(tokens[:, :-1], targets=tokens[:, 1:]).backward()
                diloco.step(samples=tokens.shape[0])
                if (step + 1) % 3 == 0:
                    states.append([t.clone() for t in diloco.shared_state()])
            diloco.finish()
        return states, [p.detach().clone() for p in model.parameters()]

    (states_a, end_a), (states_b, end_b), (_, end_c) = run_workers(3, work)
    for round_a, round_b in zip(states_a, states_b, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(round_a, round_b, strict=True))
    assert all(torch.equal(x, y) and torch.equal(x, z) for x, y, z in zip(end_a, end_b, end_c, strict=True))
    assert any(m.abs().sum() > 0 for m in states_a[-1][len(end_a) :])  # the momentum is part of it


def test_loading_the_shared_state_makes_a_fresh_worker_continue_like_the_others():
    model = make_model()
    with DiLoCo(model, adamw(model), exchange=LoopbackExchange.group(1)[0], inner_steps=2, mode="eager") as a:
        train(model, a, batches(0, 6))
        state = [t.clone() for t in a.shared_state()]
    other = TinyGPT(CONFIG)  # another initialization
    with DiLoCo(other, adamw(other), exchange=LoopbackExchange.group(1)[0], inner_steps=2, mode="eager") as b:
        b.load_shared_state(state)
        assert b.stats.resyncs == 1
        assert all(torch.equal(x, y) for x, y in zip(b.shared_state(), state, strict=True))
        assert all(torch.equal(p, c) for p, c in zip(other.parameters(), b.consensus_params, strict=True))
        with pytest.raises(ValueError, match="does not match"):
            b.load_shared_state(state[:-1])


LATENCY_S = 0.05  # well under an inner phase of 60 steps of this model (~0.15 s on 2 cores; 20 took ~0.05)


@pytest.mark.parametrize("mode", ["delayed", "eager"])
def test_background_exchange_hides_a_slow_link_behind_the_inner_phase(mode):
    waited = {}
    for run_mode in ("standard", mode):
        model = make_model()
        exchange = LoopbackExchange.group(1, latency=timedelta(seconds=LATENCY_S))[0]
        with DiLoCo(
            model, adamw(model), exchange=exchange, robust=NONE, inner_steps=60, mode=run_mode
        ) as diloco:
            train(model, diloco, batches(0, 240))
        waited[run_mode] = diloco.stats
    assert waited["standard"].waited_s > 4 * LATENCY_S
    assert waited[mode].hidden_s > 3 * LATENCY_S * 0.8  # every round but the last, still in flight at close
    assert waited[mode].waited_s < waited["standard"].waited_s / 2


def test_lossy_codec_keeps_what_it_dropped_for_the_next_round():
    model = make_model()
    codec = DCTTopKCodec(topk=2, value_bits=32)
    with DiLoCo(
        model, adamw(model), exchange=LoopbackExchange.group(1)[0], inner_steps=3, codec=codec
    ) as diloco:
        start = [p.detach().clone() for p in diloco.global_params]
        for tokens in batches(0, 3)[:-1]:
            model(tokens[:, :-1], targets=tokens[:, 1:]).backward()
            diloco.step()
        tokens = batches(0, 3)[-1]
        model(tokens[:, :-1], targets=tokens[:, 1:]).backward()
        diloco.inner_optimizer.step()
        pseudo = [s - p.detach() for s, p in zip(start, diloco.params, strict=True)]
        diloco.outer_step()
    for residual, d in zip(diloco.feedback.residuals, pseudo, strict=True):
        sent = codec.decode(codec.encode(d)) if d.numel() > 1 else d
        torch.testing.assert_close(residual, d - sent.reshape(d.shape), rtol=1e-5, atol=1e-7)


def test_sparse_error_feedback_decays_what_was_dropped_before_adding_the_new_pseudo_gradient():
    """SparseLoCo's placement: e = beta * e + delta, send C(e), keep e - C(e)."""
    model = make_model()
    codec = TopKCodec(topk=64, value_bits=2)
    with DiLoCo(
        model,
        adamw(model),
        exchange=LoopbackExchange.group(1)[0],
        inner_steps=2,
        codec=codec,
        error_decay=0.5,
    ) as diloco:
        data = batches(0, 4)
        train(model, diloco, data[:2])
        before = [r.clone() for r in diloco.feedback.residuals]
        assert any(r.abs().sum() > 0 for r in before)
        start = [p.detach().clone() for p in diloco.global_params]
        model(data[2][:, :-1], targets=data[2][:, 1:]).backward()
        diloco.step()
        model(data[3][:, :-1], targets=data[3][:, 1:]).backward()
        diloco.inner_optimizer.step()
        pseudo = [s - p.detach() for s, p in zip(start, diloco.params, strict=True)]
        diloco.outer_step()
    for residual, d, old in zip(diloco.feedback.residuals, pseudo, before, strict=True):
        accumulated = d + 0.5 * old
        sent = TopKCodec(topk=64, value_bits=2).decode(TopKCodec(topk=64, value_bits=2).encode(accumulated))
        torch.testing.assert_close(residual, accumulated - sent.reshape(d.shape), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["standard", "eager"])
def test_sparse_workers_end_on_one_model_and_send_far_less(mode):
    def work(rank, exchange):
        model = make_model()
        config = DiLoCoConfig(mode=mode, compression="sparse", topk=64, value_bits=2)
        with DiLoCo(
            model,
            adamw(model),
            exchange=exchange,
            robust=NONE,
            inner_steps=5,
            mode=mode,
            codec=codec_for(config),  # one per worker: codecs are not thread-safe
            error_decay=config.error_decay,
        ) as diloco:
            train(model, diloco, batches(rank, 15))
            diloco.finish()
            return [p.detach().clone() for p in diloco.params], diloco.stats

    results = run_workers(3, work)
    for params, _ in results[1:]:
        for a, b in zip(params, results[0][0], strict=True):
            assert torch.equal(a, b)
    numel = sum(p.numel() for p in make_model().parameters())
    for _, stats in results:  # 80x: this 21k-parameter model's many 1-D tensors cost a header each
        assert stats.outer_steps == 3 and 3 * numel * 4 / stats.bytes_sent > 60


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"error_decay": 1.5}, "error_decay"),
        ({"inner_steps": 0}, "inner_steps"),
        ({"mode": "async"}, "mode"),
        ({"outer_lr": 0}, "outer_lr"),
        ({"outer_momentum": 1.0}, "outer_momentum"),
    ],
)
def test_bad_settings_name_the_setting(kwargs, match):
    model = make_model()
    settings = {"inner_steps": 5, **kwargs}
    with pytest.raises(ValueError, match=match):
        DiLoCo(model, adamw(model), exchange=LoopbackExchange.group(1)[0], **settings)
