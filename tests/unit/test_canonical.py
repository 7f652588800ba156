"""The shared-state step gives the same bits on every kernel set (shoal.peer.algorithms.canonical): the
screened weighted mean of a round and DiLoCo's outer Nesterov step, run in fresh processes under each
CPU kernel set torch has here (ATEN_CPU_CAPABILITY) and thread count, as two volunteers' machines would
run them."""

import json
import os
import subprocess
import sys

import pytest
import torch

from shoal.compression import DenseCodec, TopKCodec
from shoal.peer.algorithms import canonical
from shoal.peer.algorithms.diloco import DiLoCo
from shoal.peer.algorithms.exchange import LoopbackExchange
from shoal.peer.models.gpt import GPTConfig, TinyGPT

# three rounds of a DiLoCo outer step over five contributions (one to be clipped), digests printed
PROBE = """
import hashlib, json, sys
import numpy as np, torch
from shoal.peer.algorithms import canonical, robust

fused = sys.argv[1] == "fused"
rng = np.random.default_rng(7)
shapes = [(257, 129), (1031,), (64, 3, 3)]
def tensor(shape):
    return torch.from_numpy(rng.standard_normal(shape).astype(np.float32))
params = [tensor(s) for s in shapes]
rounds = [[([tensor(s) for s in shapes], int(rng.integers(1, 100))) for _ in range(5)] for _ in range(3)]
if fused:  # torch's own kernels: fused multiply-adds, reductions in the kernel's order
    optimizer = torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)
else:
    optimizer = canonical.NesterovSGD(params, lr=0.7, momentum=0.9, nesterov=True)
factors = []
for contributions in rounds:
    contributions[4] = ([t * 40 for t in contributions[4][0]], contributions[4][1])
    mean = [torch.zeros_like(p) for p in params]
    if fused:
        total = float(sum(s for _, s in contributions))
        for tensors, samples in contributions:
            for m, t in zip(mean, tensors):
                m.add_(t, alpha=samples / total)
        factors.append([float(torch.cat([t.reshape(-1) for t in ts]).norm()) for ts, _ in contributions])
    else:
        total, verdict = robust.add_screened_mean(mean, contributions, robust.DILOCO)
        factors.append(verdict.factors)
    for p, m in zip(params, mean):
        p.grad = m
    optimizer.step()
state = [*params, *(optimizer.state[p]["momentum_buffer"] for p in params)]
digest = hashlib.sha256(b"".join(t.numpy().tobytes() for t in state)).hexdigest()
capability = torch.backends.cpu.get_cpu_capability()
print(json.dumps({"digest": digest, "factors": factors, "capability": capability}))
"""


def kernel_sets() -> list[str]:
    """The CPU kernel sets torch can use on this machine, plainest first."""
    best = torch.backends.cpu.get_cpu_capability().lower()
    ladder = ["default", "avx2", "avx512"]
    return ladder[: ladder.index(best) + 1] if best in ladder else ["default", best]


def probe(capability: str, threads: int, mode: str = "canonical") -> dict:
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability, "OMP_NUM_THREADS": str(threads)}
    done = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, env=env, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def test_the_shared_step_gives_the_same_bits_on_every_kernel_set_and_thread_count():
    sets = kernel_sets()
    # each kernel set once, the thread count alternating (a reduction's order would differ by both)
    runs = {(capability, 1 + i % 2): probe(capability, 1 + i % 2) for i, capability in enumerate(sets)}
    assert {run["capability"].lower() for run in runs.values()} == set(sets)  # each ran where asked
    assert len({run["digest"] for run in runs.values()}) == 1, runs
    assert len({json.dumps(run["factors"]) for run in runs.values()}) == 1
    if "avx2" in sets:  # and the probe can tell: torch's fused kernels differ between these two
        assert probe("default", 1, "fused")["digest"] != probe("avx2", 2, "fused")["digest"]


def test_the_tree_sum_is_exact_where_every_partial_sum_is():
    values = torch.arange(1, 1002, dtype=torch.float32)  # sums of integers below 2^24: exact
    assert float(canonical.tree_sum_(values.clone())) == 1001 * 1002 / 2
    assert float(canonical.tree_sum_(torch.tensor([3.0]))) == 3.0


def test_the_gram_matrix_is_symmetric_and_matches_torchs():
    generator = torch.Generator().manual_seed(1)
    rows = [[torch.randn(33, 7, generator=generator), torch.randn(5, generator=generator)] for _ in range(3)]
    gram = canonical.gram(rows)
    flat = torch.stack([torch.cat([t.reshape(-1) for t in row]) for row in rows]).double()
    torch.testing.assert_close(torch.tensor(gram, dtype=torch.float64), flat @ flat.T, rtol=1e-5, atol=1e-4)
    diagonal = canonical.gram(rows, diagonal_only=True)
    assert [diagonal[i][i] for i in range(3)] == [gram[i][i] for i in range(3)]
    assert diagonal[0][1] == 0.0


@pytest.mark.parametrize("nesterov", [True, False])
def test_nesterov_sgd_steps_as_torchs_sgd_and_shares_its_state(nesterov):
    generator = torch.Generator().manual_seed(2)
    start = [torch.randn(40, generator=generator), torch.randn(3, 5, generator=generator)]
    grads = [[torch.randn_like(p) for p in start] for _ in range(4)]
    ours = [p.clone() for p in start]
    theirs = [p.clone() for p in start]
    canonical_sgd = canonical.NesterovSGD(ours, lr=0.5, momentum=0.9, nesterov=nesterov)
    torch_sgd = torch.optim.SGD(theirs, lr=0.5, momentum=0.9, nesterov=nesterov)
    for step in grads:
        for params, optimizer in ((ours, canonical_sgd), (theirs, torch_sgd)):
            for p, g in zip(params, step, strict=True):
                p.grad = g.clone()
            optimizer.step()
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    # a checkpoint of either loads into the other (the outer state of checkpoints written before)
    torch_sgd.load_state_dict(canonical_sgd.state_dict())
    canonical_sgd.load_state_dict(torch_sgd.state_dict())
    assert canonical_sgd.state[ours[0]]["momentum_buffer"].shape == (40,)


def test_the_outer_step_refuses_a_direction_that_overflows_the_parameters():
    params = [torch.full((4,), 3e38), torch.zeros(3)]
    optimizer = canonical.NesterovSGD(params, lr=1.0, momentum=0.9, nesterov=True)
    params[0].grad, params[1].grad = torch.full((4,), -3e38), torch.ones(3)
    assert optimizer.step() is False  # 3e38 - (-3e38 * 1.9) is inf
    assert torch.equal(params[0], torch.full((4,), 3e38)) and torch.equal(params[1], torch.zeros(3))
    assert optimizer.state[params[0]] == {} and optimizer.state[params[1]] == {}  # no momentum taken
    params[0].grad, params[1].grad = torch.full((4,), 1.0), torch.ones(3)
    assert optimizer.step() is True
    assert torch.equal(params[1], torch.full((3,), -1.9))  # Nesterov: g + 0.9 * g


# DiLoCo's own transition (`DiLoCo.replay`: decoding, screening, the mean, the outer step), the code
# every peer runs on a round's payloads, over three rounds of the same payload bytes for each codec
REPLAY_PROBE = """
import hashlib, json, sys
import numpy as np, torch
from shoal.compression import DenseCodec, TopKCodec
from shoal.peer.algorithms.diloco import DiLoCo
from shoal.peer.algorithms.exchange import Contribution, LoopbackExchange
from shoal.peer.models.gpt import GPTConfig, TinyGPT

codecs = {"float32": None, "int8": DenseCodec(8, block=64),
          "sparse": TopKCodec(chunk=64, topk=8, value_bits=8)}
model = TinyGPT(GPTConfig.preset("tiny", n_layer=1, d_model=32, seq_len=16))
digests = {}
for name, rounds in json.load(open(sys.argv[1])).items():
    exchange = LoopbackExchange.group(1, trusted=False)[0]  # screened, as swarm peers are
    diloco = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), exchange=exchange, inner_steps=1,
                    mode="eager", outer_lr=0.7, outer_momentum=0.9, codec=codecs[name])
    rng = np.random.default_rng(3)
    state = [torch.from_numpy(rng.standard_normal(tuple(p.shape)).astype(np.float32))
             for _ in range(2) for p in diloco.consensus_params]
    for contributions in rounds:
        state, rejected = diloco.replay(state, [
            Contribution(rank, bytes.fromhex(data), samples, sender=bytes([rank + 1]))
            for rank, (data, samples) in enumerate(contributions)
        ])
        assert not rejected
    digests[name] = hashlib.sha256(b"".join(t.numpy().tobytes() for t in state)).hexdigest()
print(json.dumps({"digests": digests, "capability": torch.backends.cpu.get_cpu_capability()}))
"""


def test_diloco_rounds_of_every_codec_give_the_same_bits_on_every_kernel_set(tmp_path):
    """Payloads of float32, int8 and sparse (top-k) DiLoCo, made here once (their bytes are what peers
    exchange), applied for three rounds by DiLoCo's own transition in a fresh process under each kernel
    set and thread count: one digest per codec everywhere. A fifth payload 40x larger is clipped."""
    codecs = {
        "float32": None,
        "int8": DenseCodec(8, block=64),
        "sparse": TopKCodec(chunk=64, topk=8, value_bits=8),
    }
    model = TinyGPT(GPTConfig.preset("tiny", n_layer=1, d_model=32, seq_len=16))
    generator = torch.Generator().manual_seed(5)
    rounds = {}
    for name, codec in codecs.items():
        exchange = LoopbackExchange.group(1, trusted=False)[0]
        diloco = DiLoCo(
            model, torch.optim.SGD(model.parameters(), lr=0.1), exchange=exchange, inner_steps=1, codec=codec
        )
        rounds[name] = [
            [
                (
                    diloco._encode(
                        [
                            torch.randn(p.shape, generator=generator) * (40 if i == 4 else 1)
                            for p in model.parameters()
                        ],
                        samples=8 + i,
                    ).payload.hex(),
                    8 + i,
                )
                for i in range(5)
            ]
            for _ in range(3)
        ]
    payloads = tmp_path / "payloads.json"
    payloads.write_text(json.dumps(rounds))
    runs = {}
    for i, capability in enumerate(kernel_sets()):
        env = {**os.environ, "ATEN_CPU_CAPABILITY": capability, "OMP_NUM_THREADS": str(1 + i % 2)}
        done = subprocess.run(
            [sys.executable, "-c", REPLAY_PROBE, str(payloads)],
            capture_output=True, text=True, env=env, timeout=120, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        runs[capability] = json.loads(done.stdout)
    assert {run["capability"].lower() for run in runs.values()} == set(runs)
    for name in codecs:
        assert len({run["digests"][name] for run in runs.values()}) == 1, (name, runs)


# DeMo's own transition (`DeMo.replay`: decoding, screening, the weighted mean, the exact inverse
# DCT's signs, weight decay) over three rounds of the same payload bytes, with and without overlap
DEMO_PROBE = """
import hashlib, json, sys
import numpy as np, torch
from shoal.peer.algorithms.demo import DeMo
from shoal.peer.algorithms.exchange import Contribution, LoopbackExchange
from shoal.peer.models.gpt import GPTConfig, TinyGPT

model = TinyGPT(GPTConfig.preset("tiny", n_layer=1, d_model=32, seq_len=16))
rounds = json.load(open(sys.argv[1]))
digests = {}
for overlap in (False, True):
    exchange = LoopbackExchange.group(1, trusted=False)[0]  # screened and canonical, as swarm peers are
    demo = DeMo(model.parameters(), lr=0.01, exchange=exchange, weight_decay=0.1, compression_topk=8,
                overlap=overlap, lookahead=overlap)
    rng = np.random.default_rng(3)
    state = [torch.from_numpy(rng.standard_normal(tuple(p.shape)).astype(np.float32))
             for p in model.parameters()]
    for number, contributions in enumerate(rounds):
        state, rejected = demo.replay(state, [
            Contribution(rank, bytes.fromhex(data), samples, sender=bytes([rank + 1]))
            for rank, (data, samples) in enumerate(contributions)
        ], (number, number + 1))
        assert not rejected
    demo.close()
    digests[str(overlap)] = hashlib.sha256(b"".join(t.numpy().tobytes() for t in state)).hexdigest()
print(json.dumps({"digests": digests, "capability": torch.backends.cpu.get_cpu_capability()}))
"""


def demo_rounds(rounds: int = 3) -> list[list[tuple[str, int]]]:
    """`rounds` rounds of DeMo payloads (hex) and sample counts of five senders, one 40x larger (to be
    bounded), for the probe's model."""
    from shoal.peer.algorithms.demo import DeMo
    from shoal.protocol import Payload

    model = TinyGPT(GPTConfig.preset("tiny", n_layer=1, d_model=32, seq_len=16))
    demo = DeMo(model.parameters(), lr=0.01, exchange=LoopbackExchange.group(1)[0], compression_topk=8)
    generator = torch.Generator().manual_seed(6)

    def payload(scale: float) -> str:
        tensors = []
        for piece in demo._slices():
            noise = torch.randn(piece.plan.shape, generator=generator) * scale
            selection = demo.codec.select(noise, piece.plan)
            tensors.append(demo.codec.pack(selection, torch.float32))
        return Payload(tensors=tensors).SerializeToString().hex()

    return [[(payload(40.0 if i == 4 else 1.0), 8 + i) for i in range(5)] for _ in range(rounds)]


def test_demo_rounds_give_the_same_bits_on_every_kernel_set(tmp_path):
    """DeMo payloads made here once, applied for three rounds by DeMo's own transition in a fresh
    process under each kernel set and thread count: one digest, with and without overlap."""
    rounds = demo_rounds()
    payloads = tmp_path / "payloads.json"
    payloads.write_text(json.dumps(rounds))

    def run(capability: str, threads: int, gemm: str = "AUTO") -> dict:
        # MKL_CBWR=COMPATIBLE: MKL's matrix products in another order, as another CPU's or a GPU's
        env = {**os.environ, "ATEN_CPU_CAPABILITY": capability, "OMP_NUM_THREADS": str(threads)}
        done = subprocess.run(
            [sys.executable, "-c", DEMO_PROBE, str(payloads)],
            capture_output=True, text=True, env={**env, "MKL_CBWR": gemm}, timeout=120, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout)

    sets = kernel_sets()
    runs = {capability: run(capability, 2 - i % 2) for i, capability in enumerate(sets)}
    assert {run["capability"].lower() for run in runs.values()} == set(runs)
    runs["compatible"] = run(sets[-1], 2, "COMPATIBLE")
    for overlap in ("False", "True"):
        assert len({run["digests"][overlap] for run in runs.values()}) == 1, (overlap, runs)
