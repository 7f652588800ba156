"""Butterfly averaging in real swarms (coordinator, DHT, libp2p streams; separate processes on
127.0.0.1): the peers end on one state having sent fewer bytes than a gather would, and a peer that
lies about its piece's mean is struck while the others average its piece themselves; requests for
pieces out of bounds get nothing."""

import json
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch

from shoal.compression import DenseCodec
from shoal.peer.algorithms.butterfly import Pieces
from shoal.peer.algorithms.robust import NONE
from shoal.peer.models.gpt import GPTConfig, TinyGPT
from shoal.peer.swarm.exchange import SwarmExchange
from shoal.peer.swarm.server import MAX_PIECES, PARTS_QUIET_S
from shoal.protocol import Payload
from shoal.protocol.swarm_pb2 import PayloadRequest
from tests.integration.harness import events, free_port, kill, shoal, start, swarm, wait_for


def int8_payload_bytes() -> int:
    """A tiny GPT's pseudo-gradients as DenseCodec(8) sends them: a byte per value, a float32 scale
    per block of 64 (zstd aside)."""
    numel = sum(p.numel() for p in TinyGPT(GPTConfig.preset("tiny")).parameters())
    return numel + 4 * -(-numel // 64)


@pytest.mark.timeout(200)
def test_demo_averages_piece_by_piece_and_the_peers_agree():
    peers, rounds = 3, 6
    result = shoal(
        "demo", "--peers", str(peers), "--rounds", str(rounds), "--algorithm", "diloco",
        "--averaging", "butterfly", "--json", timeout=180,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout)
    assert summary["param_hash_agree"] is True
    assert summary["final_loss"] < summary["initial_loss"] - 0.5
    assert summary["coordinated_rounds"] >= peers * (rounds - 1)
    # every coordinated round is averaged piece by piece, but one that a straggler (this machine busy)
    # left with fewer than butterfly.MIN_PARTICIPANTS = 3: that one is gathered, on each of the 3 peers
    gathered = summary["coordinated_rounds"] - summary["butterfly_rounds"]
    assert summary["butterfly_rounds"] > 0 and gathered <= peers * summary["stragglers_excluded"], summary
    assert summary["pieces_recomputed"] == 0
    # a gather sends each payload to the 2 others; a butterfly 2 pieces and 2 copies of a mean of a
    # third of it each, 4/3 of a payload (the rest: DHT, coordinator, state digests)
    gather = 2 * int8_payload_bytes()
    assert summary["bytes_sent_per_peer_per_round"] < 0.8 * gather


@pytest.mark.timeout(240)
def test_a_peer_serving_a_garbage_mean_is_struck_and_its_piece_averaged_by_the_others(tmp_path):
    address = f"127.0.0.1:{free_port()}"
    flags = ["--listen", address, "--state", str(tmp_path / "c.db"), "--min-peers", "3"]
    flags += ["--min-compute-s", "1.5", "--max-compute-s", "3"]
    log = (tmp_path / "coordinator.log").open("w")
    coordinator = start("coordinator", *flags, stdout=subprocess.DEVNULL, stderr=log)
    common = ["--host", "127.0.0.1", "--run", "liar", "--log-format", "json", "--round-seconds", "3"]
    common += ["--coordinator", address, "--algorithm", "diloco"]
    common += ["--averaging", "butterfly", "--inner-steps", "4"]
    processes = [coordinator]

    def join(name: str, *flags: str, liar: bool = False) -> None:
        out, err = (tmp_path / f"{name}.jsonl").open("w"), (tmp_path / f"{name}.log").open("w")
        fault = {"SHOAL_FAULTS": "tests.integration.faults:butterfly_lie@0"} if liar else None
        processes.append(start("join", *common, *flags, env=fault, stdout=out, stderr=err))

    try:
        # all leave after round 7: in that last round the honest peers average the liar's piece from
        # the parts, the liar's included, which it serves while it drains (else they could end on
        # different parameters, with no next round's state check to find it)
        join("honest0", "--until-round", "7")
        first = wait_for(tmp_path / "honest0.jsonl", lambda e: e.get("event") == "started", 60)
        initial = ["--initial-peers", first["initial_peers"][0]]
        join("honest1", "--until-round", "7", *initial)
        join("liar", "--until-round", "7", *initial, liar=True)
        codes = [process.wait(timeout=200) for process in processes[1:]]
        assert codes == [0, 0, 0], [
            (tmp_path / f"{n}.log").read_text()[-2000:] for n in ("honest0", "honest1")
        ]
    finally:
        for process in processes:
            kill(process)
    summaries = {
        name: next(e for e in events(tmp_path / f"{name}.jsonl") if e.get("event") == "summary")
        for name in ("honest0", "honest1", "liar")
    }
    honest = [summaries["honest0"], summaries["honest1"]]
    assert honest[0]["param_hash"] == honest[1]["param_hash"]
    assert all(s["butterfly_rounds"] >= 4 for s in honest)
    for s in honest:  # the lies were caught and counted, and the liar's piece averaged here instead
        assert s["rejected"].get("unparsable", 0) >= 2 and s["pieces_recomputed"] >= 2, s
    # the liar kept its own mean, so its state left the others': it was told and re-synced
    assert summaries["liar"]["resyncs"] >= 1
    assert honest[0]["final_loss"] < honest[0]["initial_loss"]


@pytest.mark.timeout(90)
def test_piece_requests_out_of_bounds_get_nothing_and_are_counted():
    codec, shapes = DenseCodec(8, block=8), [torch.Size([40, 3]), torch.Size([17])]
    with swarm([SwarmExchange] * 2, round_seconds=3) as (exchanges, schedule):
        author, asker = exchanges
        generator = torch.Generator().manual_seed(0)
        tensors = [torch.randn(shape, generator=generator) for shape in shapes]
        payload = Payload(tensors=[codec.encode(t) for t in tensors]).SerializeToString()
        time.sleep(max(0.0, schedule.start_time - time.time()))
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda e: e.gather(payload, samples=1), exchanges))
        number, digest = author.server.mine

        def ask(**fields) -> bytes:
            request = PayloadRequest(round=number, digest=digest, **fields)
            return asker._call(asker.puller.pull(author.peer_id, "shoal.r.payload", request, 1 << 20))

        assert ask(shard=0, shards=3) == b""  # not a butterfly round: no pieces
        author.server.cuttable_from(number, digest)  # as a coordinated round with butterfly averaging does
        assert ask(shard=3, shards=3) == b"" and ask(shard=0, shards=MAX_PIECES + 1) == b""
        assert author.counts.rejected["bad_request"] == 2
        pieces = Pieces(codec, shapes, robust=NONE)
        decoded = [pieces.decode(k, 3, ask(shard=k, shards=3)) for k in range(3)]
        whole = [codec.decode(m) for m in Payload.FromString(payload).tensors]
        assert all(torch.equal(a, b) for a, b in zip(pieces.assemble(decoded), whole, strict=True))
        assert ask(shard=1, shards=4)  # a second way to cut it, then no more: each costs a pass
        assert ask(shard=1, shards=5) == b"" and author.counts.rejected["bad_request"] == 3
        started = time.monotonic()
        assert ask(shard=0, shards=3, reduced=True) == b""  # it owns no mean of this round
        assert time.monotonic() - started < 5
        assert ask() == payload  # and it still serves the whole payload
        served = time.monotonic()
        assert ask(shard=2, shards=3)  # a part, as a peer averaging a lost owner's piece asks for it
        assert author.close(drain=timedelta(seconds=10)) is True  # everyone pulled its payload ...
        assert PARTS_QUIET_S <= time.monotonic() - served < 5  # ... and it waited for part requests to stop
