"""Learning-rate schedules that follow the swarm's round (shoal.peer.algorithms.schedule): their shapes,
the settings that refuse a schedule that does not fit, and trainers that join late or come back from a
checkpoint stepping at the learning rate of the peers that never left."""

import math

import pytest
import torch

from shoal.peer.algorithms.configs import DeMoConfig, DiLoCoConfig
from shoal.peer.algorithms.exchange import LoopbackExchange
from shoal.peer.algorithms.schedule import Schedule
from shoal.peer.checkpoint import CheckpointStore
from shoal.peer.config.spec import PeerSpec
from shoal.peer.train.trainer import Trainer
from tests.unit.test_runtime import Linear, batches


def test_shapes():
    cosine = Schedule(kind="cosine", warmup=10, decay=90, min_lr=0.1)
    assert cosine.lr(1.0, 0) == pytest.approx(0.1) and cosine.lr(1.0, 9) == 1.0
    assert cosine.lr(1.0, 10) == 1.0 and cosine.lr(1.0, 55) == pytest.approx(0.55)
    assert cosine.lr(1.0, 100) == pytest.approx(0.1) and cosine.lr(1.0, 10_000) == pytest.approx(0.1)
    linear = Schedule(kind="linear", decay=100)
    assert linear.lr(2.0, 50) == pytest.approx(1.0) and linear.lr(2.0, 25.5) == pytest.approx(1.49)
    wsd = Schedule(kind="wsd", warmup=5, decay=20, total=100, min_lr=0.0)
    assert wsd.lr(1.0, 50) == 1.0 and wsd.lr(1.0, 80) == 1.0 and wsd.lr(1.0, 90) == pytest.approx(0.5)
    assert Schedule().lr(3e-4, 12345.5) == 3e-4
    assert Schedule(warmup=4).lr(1.0, 1) == 0.5 and Schedule(warmup=4).run_config()["warmup_rounds"] == "4"
    assert Schedule().run_config() == {}  # a run without a schedule keeps its hash


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (
            {"lr_schedule": "cosine"},
            "--decay-rounds: a cosine schedule needs --decay-rounds or --until-round",
        ),
        ({"lr_schedule": "linear", "decay_rounds": 5, "warmup_rounds": 6}, "--warmup-rounds: the warmup (6"),
        ({"lr_schedule": "wsd", "until_round": 9, "decay_rounds": 8, "warmup_rounds": 5}, "--decay-rounds:"),
    ],
)
def test_a_schedule_that_does_not_fit_is_named(flags, said):
    with pytest.raises(ValueError) as error:
        PeerSpec.of(**flags)
    assert str(error.value).startswith(said)


def test_the_schedule_is_part_of_the_run_configuration():
    plain, scheduled = PeerSpec.of(), PeerSpec.of(lr_schedule="cosine", until_round=99, warmup_rounds=10)
    assert "lr_schedule" not in plain.run_config()
    config = scheduled.run_config()
    assert config["lr_schedule"] == "cosine" and config["decay_rounds"] == "90"
    assert PeerSpec.of(grad_clip=1.0, weight_decay=0.05).run_config()["weight_decay"] == "0.05"


def _trainer(algorithm, schedule, **kwargs) -> Trainer:
    torch.manual_seed(0)
    exchange = LoopbackExchange.group(1)[0]
    return Trainer(Linear(), exchange, algorithm=algorithm, batches=batches, schedule=schedule, **kwargs)


def test_a_joiner_and_a_restarted_peer_step_at_the_swarms_rate(tmp_path):
    schedule = Schedule(kind="cosine", warmup=3, decay=17, min_lr=1e-4)
    stayed = _trainer(DeMoConfig(lr=1e-2), schedule, checkpoints=CheckpointStore(tmp_path))
    rates = {}
    for number in range(12):
        rates[number] = stayed.round(number).lr
        if number == 5:
            stayed.save()
    assert rates[0] < rates[1] < rates[2] == rates[3] > rates[11]  # warmed up, then decaying
    joiner = _trainer(DeMoConfig(lr=1e-2), schedule)
    assert [joiner.round(n).lr for n in (9, 10, 11)] == [rates[9], rates[10], rates[11]]
    restarted = _trainer(DeMoConfig(lr=1e-2), schedule, checkpoints=CheckpointStore(tmp_path))
    assert restarted.resume()
    assert [restarted.round(n).lr for n in (8, 9)] == [rates[8], rates[9]]
    assert restarted.sync.optimizer.param_groups[0]["lr"] == rates[9]


def test_diloco_inner_steps_follow_the_schedule_within_the_round():
    schedule = Schedule(kind="linear", decay=10)
    trainer = _trainer(DiLoCoConfig(lr=1.0, inner_steps=4), schedule, grad_clip=0.5, weight_decay=0.0)
    seen = []
    original = trainer.sync.set_lr
    trainer.sync.set_lr = lambda lr: (seen.append(lr), original(lr))
    trainer.round(5)
    assert seen == pytest.approx([0.5, 0.475, 0.45, 0.425])
    assert trainer.sync.inner.param_groups[0]["weight_decay"] == 0.0
    assert all(math.isfinite(p.sum().item()) for p in trainer.model.parameters())
