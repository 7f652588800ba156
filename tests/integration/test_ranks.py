"""Several ranks as one peer (shoal.peer.train.ranks), on the CPU over gloo: a trainer whose micro-batches two
ranks compute (the second a real `python -m shoal.peer.train.ranks` process) takes the steps one process
takes on the same micro-batches; and in a swarm, a `shoal join --nproc-per-node 2` peer and a
single-process peer end on one model, the two-rank peer claiming the samples of both its ranks."""

import json

import pytest
import torch

from shoal.peer.algorithms.configs import DEFAULTS
from shoal.peer.algorithms.exchange import LoopbackExchange
from shoal.peer.models.loading import load_model
from shoal.peer.train.ranks import start_ranks
from shoal.peer.train.trainer import Trainer
from tests.integration.harness import kill, start, wait_for


def trainer(algorithm: str, ranks=None, max_micro_batches: int = 1) -> Trainer:
    loaded = load_model("tiny", seed=3)

    def batches(step, micro, size, plan):
        generator = torch.Generator().manual_seed(1000 * step + micro)
        rows = torch.randint(0, 256, (size, loaded.seq_len + 1), generator=generator)
        return rows[:, :-1], rows[:, 1:]

    made = Trainer(
        loaded.module,
        LoopbackExchange.group(1)[0],
        algorithm=DEFAULTS[algorithm],
        batches=batches,
        batch_size=4,
        max_micro_batches=max_micro_batches,
        ranks=ranks,
    )
    made.micro_batches = max_micro_batches // (1 if ranks is None else ranks.world)  # 2 alone, 1 a rank
    return made


@pytest.mark.timeout(120)
@pytest.mark.parametrize("algorithm", ["demo", "diloco-standard"])
def test_two_ranks_take_the_steps_one_process_takes_on_their_micro_batches(algorithm):
    alone = trainer(algorithm, max_micro_batches=2)
    single = [alone.round().samples for _ in range(3)]
    ranks = start_ranks(
        2,
        torch.device("cpu"),
        {"name": "tiny", "seed": 99, "seq_len": None, "checkpointing": False, "precision": "fp32"},
    )
    together = trainer(algorithm, ranks=ranks, max_micro_batches=2)
    try:
        ranked = [together.round().samples for _ in range(3)]
    finally:
        together.close()
    assert ranks.workers[0].returncode == 0  # told to stop, and it did
    assert ranked == single == [8 * alone.inner_steps] * 3
    for a, b in zip(alone.model.parameters(), together.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(240)
def test_a_two_rank_peer_and_a_one_process_peer_end_on_one_model(tmp_path):
    common = ["--host", "127.0.0.1", "--run", "ranks", "--log-format", "json", "--round-seconds", "3"]
    common += ["--until-round", "5", "--max-micro-batches", "2", "--batch-size", "4"]
    outs = [tmp_path / "ranked.jsonl", tmp_path / "single.jsonl"]
    peers = []
    try:
        peers.append(start("join", *common, "--nproc-per-node", "2", stdout=outs[0].open("w")))
        started = wait_for(outs[0], lambda e: e.get("event") == "started", 120)
        joiner = ["--initial-peers", started["initial_peers"][0]]
        peers.append(start("join", *common, *joiner, stdout=outs[1].open("w")))
        summaries = [wait_for(out, lambda e: e.get("event") == "summary", 150) for out in outs]
        assert [peer.wait(timeout=60) for peer in peers] == [0, 0]
    finally:
        for peer in peers:
            kill(peer)
    ranked, single = summaries
    assert ranked["param_hash"] == single["param_hash"], summaries
    # each round's samples: every micro-batch of every rank (micro_batches "MxB": M per rank, B each)
    for out, ranks in zip(outs, (2, 1), strict=True):
        events = [json.loads(line) for line in out.read_text().splitlines()]
        rounds = [e for e in events if e.get("event") == "round"]
        assert len(rounds) >= 5
        for e in rounds:
            micro, size = map(int, e["micro_batches"].split("x"))
            assert e["samples"] == ranks * micro * size, e
