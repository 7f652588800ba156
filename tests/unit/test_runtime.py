"""The peer runtime's pieces: data slices per (round, slot), micro-batches that halve on out-of-memory
and fill the compute window, phase timings, and what `--model` can name."""

import time

import pytest
import torch
from torch import nn

from shoal.peer.algorithms.configs import DeMoConfig, DiLoCoConfig
from shoal.peer.algorithms.exchange import LoopbackExchange
from shoal.peer.data import RoundSlices
from shoal.peer.models.loading import ModelError, load_model
from shoal.peer.train.trainer import PHASES, OutOfMemory, Trainer

STREAM = torch.arange(100_000)  # window i starts with token 10 * i (seq_len 9)


@pytest.mark.parametrize("slots", [1, 3, 7])
def test_no_two_slots_share_a_window_within_a_round(slots):
    slices = RoundSlices(seq_len=9, stride=4, seed=1)
    indices = []
    for slot in range(slots):
        for micro in range(5):
            size = 4 if slot % 2 else 2  # peers with different micro-batch sizes
            inputs, targets = slices.batch(
                STREAM, round_number=3, slot=slot, slots=slots, micro=micro, batch_size=size
            )
            assert inputs.shape == targets.shape == (size, 9)
            assert torch.equal(inputs[:, 1:], targets[:, :-1])
            indices += (inputs[:, 0] // 10).tolist()
    assert len(indices) == len(set(indices)) == sum(4 if s % 2 else 2 for s in range(slots)) * 5


def test_rounds_draw_other_windows_deterministically():
    slices = RoundSlices(seq_len=9, stride=8)
    first = slices.batch(STREAM, round_number=0, slot=0, slots=2, micro=0, batch_size=8)[0]
    again = slices.batch(STREAM, round_number=0, slot=0, slots=2, micro=0, batch_size=8)[0]
    other = slices.batch(STREAM, round_number=1, slot=0, slots=2, micro=0, batch_size=8)[0]
    assert torch.equal(first, again) and not torch.equal(first, other)
    with pytest.raises(ValueError, match="batch size 9"):
        slices.batch(STREAM, round_number=0, slot=0, slots=2, micro=0, batch_size=9)
    with pytest.raises(ValueError, match="slot 2"):
        slices.batch(STREAM, round_number=0, slot=2, slots=2, micro=0, batch_size=1)


class Linear(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 1)

    def forward(self, inputs, targets):
        return ((self.layer(inputs) - targets) ** 2).mean()


def batches(step: int, micro: int, size: int, plan=None):
    generator = torch.Generator().manual_seed(step * 1000 + micro)
    return torch.randn(size, 4, generator=generator), torch.randn(size, 1, generator=generator)


def trainer(**kwargs) -> Trainer:
    torch.manual_seed(0)
    return Trainer(Linear(), LoopbackExchange.group(1)[0], algorithm=DeMoConfig(), batches=batches, **kwargs)


def test_out_of_memory_halves_the_micro_batch_and_restarts_the_step():
    calls = []

    def loss_fn(model, inputs, targets):
        calls.append(inputs.shape[0])
        if inputs.shape[0] > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return model(inputs, targets)

    peer = trainer(loss_fn=loss_fn, batch_size=8)
    report = peer.round()
    assert calls == [8, 4, 2]
    assert (peer.batch_size, peer.out_of_memory, report.samples, report.batch_size) == (2, 2, 2, 2)
    assert all(p.grad is None for p in peer.model.parameters())  # the step consumed them


def test_out_of_memory_at_one_sample_is_a_clear_error():
    def loss_fn(model, inputs, targets):
        raise RuntimeError("MPS backend out of memory (MPS allocated: 9 GB)")

    with pytest.raises(OutOfMemory, match="smaller --model"):
        trainer(loss_fn=loss_fn, batch_size=2).round()


def test_other_errors_are_not_taken_for_out_of_memory():
    def loss_fn(model, inputs, targets):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    with pytest.raises(RuntimeError, match="shapes"):
        trainer(loss_fn=loss_fn).round()


def test_micro_batches_fill_the_compute_window():
    def slow_loss(model, inputs, targets):
        time.sleep(0.01)
        return model(inputs, targets)

    peer = trainer(loss_fn=slow_loss, compute_window=0.1, max_micro_batches=50)
    reports = [peer.round() for _ in range(4)]
    assert reports[0].micro_batches == 1
    assert 4 <= reports[-1].micro_batches <= 10  # ~0.1 s / 0.01 s, less per-batch overhead
    assert reports[-1].samples == reports[-1].micro_batches * 8
    assert set(reports[-1].phases) == set(PHASES)
    assert reports[-1].phases["compute"] >= 0.01 * reports[-1].micro_batches
    assert reports[-1].compute_s == reports[-1].phases["compute"]


def test_a_pace_measured_before_training_fills_the_first_round():
    """A pace given before training (`shoal join`'s fit dry run) fills the first window, where a
    trainer that learns it computes one micro-batch; a pace the rounds measured is not replaced."""

    peer = trainer(compute_window=0.1, max_micro_batches=50)
    peer.expect_pace(0.01)
    assert 4 <= peer.round().micro_batches <= 10  # ~0.1 s / 0.01 s, less per-batch overhead
    learned = peer.micro_batches
    peer.expect_pace(1.0)
    assert peer.micro_batches == learned


def test_a_diloco_round_fills_its_window_with_more_micro_batches_than_it_has_steps():
    """H = 4 steps in a window of about 7 micro-batches: the remainder goes to some of the steps
    instead of being lost to one micro-batch a step (4 of 7)."""

    def slow_loss(model, inputs, targets):
        time.sleep(0.02)
        return model(inputs, targets)

    torch.manual_seed(0)
    algorithm = DiLoCoConfig(inner_steps=4)
    peer = Trainer(
        Linear(), LoopbackExchange.group(1)[0], algorithm=algorithm, batches=batches, loss_fn=slow_loss,
        compute_window=0.15, max_micro_batches=50,
    )  # fmt: skip
    reports = [peer.round() for _ in range(3)]
    assert peer.micro_batches == 1  # 0.15 s / (4 steps x 0.02 s): one each, and a remainder
    assert 5 * 8 <= reports[-1].samples <= 7 * 8
    assert reports[-1].phases["compute"] <= 0.15 + 0.05


def test_accumulated_micro_batches_give_the_mean_gradient():
    # two micro-batches of 4 accumulate the gradient of their mean loss, as one batch of 8 would
    peer = trainer(batch_size=4)
    peer.micro_batches = 2
    grads = []
    peer.sync.optimizer.step = lambda samples, plan=None: grads.append(
        [p.grad.clone() for p in peer.model.parameters()]
    )
    peer.round()
    model = Linear()
    model.load_state_dict(peer.model.state_dict())
    losses = [model(*batches(0, micro, 4)) for micro in range(2)]
    (sum(losses) / 2).backward()
    for got, expected in zip(grads[0], [p.grad for p in model.parameters()], strict=True):
        torch.testing.assert_close(got, expected)


def test_a_step_whose_micro_batches_slow_down_stops_at_its_window_with_the_mean_gradient():
    """Fitted to 10 micro-batches of 0.01 s in a 0.1 s window; then each takes 0.05 s (the device is
    shared now): the step stops after the one that passes the window, not 0.5 s later, and the
    gradient is the mean of the micro-batches it did."""
    delay = [0.01]

    def slow_loss(model, inputs, targets):
        time.sleep(delay[0])
        return model(inputs, targets)

    peer = trainer(loss_fn=slow_loss, compute_window=0.1, max_micro_batches=50, batch_size=4)
    for _ in range(4):
        peer.round()
    assert peer.micro_batches >= 4 and peer.cut_short == 0
    planned, delay[0] = peer.micro_batches, 0.05
    grads = []
    peer.sync.optimizer.step = lambda samples, plan=None: grads.append(
        [p.grad.clone() for p in peer.model.parameters()]
    )
    started = time.perf_counter()
    report = peer.round()
    assert time.perf_counter() - started < 0.1 + 3 * 0.05
    assert peer.cut_short == 1 and 1 <= report.samples // 4 < planned
    done = report.samples // 4
    model = Linear()
    model.load_state_dict(peer.model.state_dict())
    mean = sum(model(*batches(peer.steps - 1, micro, 4)) for micro in range(done)) / done
    mean.backward()
    for got, expected in zip(grads[0], [p.grad for p in model.parameters()], strict=True):
        torch.testing.assert_close(got, expected)
    # the loss it reports is the mean over the micro-batches it did, not over those it planned
    assert report.loss == pytest.approx(mean.item(), rel=1e-5)
    assert peer.micro_batches < planned  # and the next rounds plan fewer


def factory():
    model = Linear()
    model.seq_len = 4
    return model, lambda m, inputs, targets: m(inputs, targets)


def test_models_by_preset_factory_and_errors():
    tiny = load_model("tiny", seed=3)
    assert tiny.seq_len == 64 and tiny.vocab_size == 256 and tiny.parameters > 100_000
    assert torch.equal(next(tiny.module.parameters()), next(load_model("tiny", seed=3).module.parameters()))
    custom = load_model("tests.unit.test_runtime:factory")
    assert custom.seq_len == 4 and type(custom.module).__name__ == "Linear"
    with pytest.raises(ModelError, match="no attribute 'nothing'"):
        load_model("tests.unit.test_runtime:nothing")
    with pytest.raises(ModelError, match="No module named"):
        load_model("no_such_module:factory")
    with pytest.raises(ModelError, match="expected one of tiny, small, base"):
        load_model("gpt-17")


def test_demo_overlap_checkpoints_the_shared_parameters_and_finish_applies_the_last_round():
    torch.manual_seed(0)
    peer = Trainer(
        Linear(), LoopbackExchange.group(1)[0], algorithm=DeMoConfig(overlapped=True), batches=batches
    )
    peer.run(3)
    shared = [t.clone() for t in peer.sync.shared_state()]
    live = [p.detach().clone() for p in peer.model.parameters()]
    assert any(not torch.equal(a, b) for a, b in zip(live, shared, strict=True))  # the lookahead's guess
    state = peer.state_dict()
    assert all(
        torch.equal(state["model"][name], t)
        for (name, _), t in zip(peer.model.named_parameters(), shared, strict=True)
    )
    peer.finish()
    assert any(not torch.equal(p, t) for p, t in zip(peer.model.parameters(), shared, strict=True))
    peer.close()


def test_a_diloco_config_builds_its_outer_loop_and_its_name_goes_into_checkpoints():
    algorithm = DiLoCoConfig(mode="eager", lr=1e-2, inner_steps=3, outer_lr=0.5)
    peer = Trainer(Linear(), LoopbackExchange.group(1)[0], algorithm=algorithm, batches=batches)
    assert (peer.inner_steps, peer.sync.diloco.mode, peer.sync.diloco.inner_steps) == (3, "eager", 3)
    assert peer.sync.inner.param_groups[0]["lr"] == 1e-2
    assert peer.sync.diloco.outer_optimizer.param_groups[0]["momentum"] == 0.0  # eager's (OUTER_MOMENTUM)
    assert peer.sync.diloco.outer_optimizer.param_groups[0]["lr"] == 0.5
    peer.run(2)
    assert peer.rounds_done == 2 and peer.state_dict()["algorithm"] == "diloco-eager"
    with pytest.raises(ValueError, match="checkpoint of 'diloco-eager', this peer runs 'demo'"):
        trainer().load_state_dict(peer.state_dict())
    peer.close()


class PlanRecorder(LoopbackExchange):
    """A one-worker loopback that records the plan each gather was handed."""

    def __init__(self):
        single = LoopbackExchange.group(1)[0]
        super().__init__(single._hub, 0)
        self.plans: list[object] = []

    def gather(self, payload, samples, state=None, plan=None):
        self.plans.append(plan)
        return super().gather(payload, samples, state, plan)


@pytest.mark.parametrize(
    "algorithm",
    [
        DeMoConfig(),
        DeMoConfig(overlapped=True),
        DiLoCoConfig(mode="standard", inner_steps=2),
        DiLoCoConfig(mode="eager", inner_steps=2),
    ],
    ids=["demo", "demo-overlap", "diloco-standard", "diloco-eager"],
)
def test_each_round_hands_its_own_plan_to_the_exchange_with_its_payload(algorithm):
    """The plan travels with the payload: an overlapped optimizer's gather, a round late on its own
    thread, takes the plan of the round it computed, not the one the loop planned since."""
    exchange = PlanRecorder()
    peer = Trainer(Linear(), exchange, algorithm=algorithm, batches=batches)
    reports = [peer.round(number, plan=f"plan {number}") for number in (5, 6, 7)]
    peer.finish()
    assert exchange.plans == ["plan 5", "plan 6", "plan 7"]
    assert [r.round for r in reports] == [5, 6, 7]
    peer.close()


def test_a_checkpoint_carries_the_token_ledger(tmp_path):
    from shoal.peer.checkpoint import CheckpointStore
    from shoal.peer.data.ledger import TokenLedger

    peer = trainer(checkpoints=CheckpointStore(tmp_path))
    peer.ledger = ledger = TokenLedger(100, 4, seed=1)
    lane = ledger.lane(0, 0, 1)
    lane.windows = 12
    ledger.record(0, {b"me": lane.claim()})
    ledger.view(1)  # settles round 0: 3 chunks consumed
    peer.round()
    peer.save()
    restarted = trainer(checkpoints=CheckpointStore(tmp_path))
    restarted.ledger = fresh = TokenLedger(100, 4, seed=1)
    assert restarted.resume()
    assert fresh.to_bytes() == ledger.to_bytes() and fresh.progress()[2] == 12


def test_activation_checkpointing_gives_the_same_gradients():
    from shoal.peer.job.assembly import checkpoint_activations

    plain, checkpointed = load_model("tiny", seed=4).module, load_model("tiny", seed=4).module
    checkpoint_activations(checkpointed, "tiny")
    tokens = torch.randint(0, 256, (2, 65))
    for model in (plain, checkpointed):
        model(tokens[:, :-1], targets=tokens[:, 1:]).backward()
    for a, b in zip(plain.parameters(), checkpointed.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad)
    with pytest.raises(ValueError, match="--activation-checkpointing on: --model m has no way"):
        checkpoint_activations(torch.nn.Linear(2, 2), "m")


def test_a_stop_that_comes_after_a_rounds_checkpoint_ends_the_next_round_with_one():
    """A signal that lands while the caller handles a round (after that round's checkpoint was due)
    stops the peer at the next round's end, checkpointed; it never leaves without one (seen in CI: a
    SIGTERM between the two reads of the stop left no checkpoint)."""
    from types import SimpleNamespace

    from shoal.peer.job.runtime import SwarmPeer
    from shoal.peer.swarm.records import RoundPlan, RoundStatus
    from shoal.peer.train.stopping import StopRequest

    saved, rounds = [], iter(range(10))
    status = RoundStatus(
        round=None, needed=None, shared=False, late=0, isolated=False, peers_seen=1, stragglers=0,
        clocks_adopted=0, resyncs=0, resync_bytes=0, payload_bytes=0, bytes_sent=0, bytes_received=0,
        round_seconds=1.0, ledger=None,
    )  # fmt: skip
    exchange = SimpleNamespace(
        status=lambda: status,
        last_round=None,
        next_round=0,
        coordinator=None,
        plan_round=lambda until: RoundPlan(
            round=next(rounds), coordinated=False, compute_seconds=None, data_seed=None, slot=(0, 1)
        ),
        set_progress=lambda **progress: None,
    )
    report = SimpleNamespace(phases={"encode": 0.0}, samples=1, compute_s=1.0)
    trainer = SimpleNamespace(
        compute_window=None,
        batch_size=1,
        inner_steps=1,
        round=lambda number, plan: report,
        end_round=lambda stopping: saved.append(stopping),
    )
    peer = SwarmPeer(None, None, "run")
    peer.exchange, peer.trainer = exchange, trainer
    stop = StopRequest()
    done = []
    for finished in peer.rounds(stop=stop):
        done.append(finished.plan.round)
        if len(done) == 2:
            stop.set()  # after round 1's end_round read the stop as unset
    assert done == [0, 1, 2] and saved == [False, False, True] and peer.stopped


def test_loss_scaling_unscales_the_gradients_and_drops_a_step_that_overflowed():
    """fp16's dynamic loss scale (hardware.LossScale): the optimizer sees the true gradients; a step
    whose scaled gradients overflowed reaches it zeroed, counted, and the scale is halved; after
    `growth_every` good steps it doubles again."""
    from shoal.peer.train.hardware import LossScale

    plain = trainer()
    scaled = trainer(loss_scale=LossScale(scale=2.0**10, growth_every=2))
    seen = {}
    for name, peer in (("plain", plain), ("scaled", scaled)):
        peer.sync.optimizer.step = lambda samples, plan=None, name=name, peer=peer: seen.setdefault(
            name, [p.grad.clone() for p in peer.model.parameters()]
        )
        peer.round()
    for got, want in zip(seen["scaled"], seen["plain"], strict=True):
        torch.testing.assert_close(got, want)  # the same gradient, scaled and unscaled exactly (2^10)
    assert scaled.loss_scale.scale == 2.0**10 and scaled.loss_scale.skipped == 0
    scaled.round()
    assert scaled.loss_scale.scale == 2.0**11  # two good steps: doubled
    scaled.loss_scale.scale = 2.0**200  # the next loss overflows float32 too once scaled
    grads = []
    scaled.sync.optimizer.step = lambda samples, plan=None: grads.append(
        [p.grad.clone() for p in scaled.model.parameters()]
    )
    scaled.round()
    assert scaled.loss_scale.skipped == 1 and scaled.loss_scale.scale == 2.0**199
    assert all(torch.count_nonzero(g) == 0 for g in grads[0])


def test_fp16_autocast_with_loss_scaling_trains_the_embedded_gpt():
    from shoal.peer.train.hardware import LossScale, autocast_for

    torch.manual_seed(0)
    loaded = load_model("tiny")
    rows = torch.randint(0, 256, (8, loaded.seq_len + 1))
    peer = Trainer(
        loaded.module,
        LoopbackExchange.group(1)[0],
        algorithm=DeMoConfig(lr=3e-3),
        batches=lambda step, micro, size, plan: (rows[:size, :-1], rows[:size, 1:]),
        autocast=autocast_for(torch.device("cpu"), "fp16"),
        loss_scale=LossScale(),
    )
    losses = [peer.round().loss for _ in range(8)]
    assert losses[-1] < losses[0] - 0.2 and peer.loss_scale.skipped == 0
