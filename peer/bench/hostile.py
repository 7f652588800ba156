"""`shoal bench hostile`: how far attackers that send well-formed payloads move training.

    shoal bench hostile                    # 2 attackers among 8 workers, every attack, DeMo and DiLoCo
    shoal bench hostile --json --workers 4 --attackers 1 --attacks sign_flip --methods demo_compact

The `shoal bench converge --quick` setting (tiny GPT, standard-library corpus, 300 steps of 16
sequences per worker, loopback threads), with the last `attackers` workers hostile. An attacker trains
like everyone else and changes only the bytes and the sample count it sends (`Poisoned`):

- sign_flip: its own update negated and scaled to `SCALE` times its norm;
- sample_lie: sign_flip, and a claim of 2^40 samples (what DiLoCo's mean is weighted by);
- random: random directions (DeMo: random indices, gaussian values) at `SCALE` times its norm;
- alie, "a little is enough" (Baruch, Baruch and Goldberg, NeurIPS 2019): its own update plus its own
  norm along one fixed direction, the same every round (DeMo: that direction read at the coefficients
  it sends), which stays inside the honest spread of norms and cosines and pushes the same way every
  round;
- collude: every attacker sends the same payload, the first attacker's update negated at
  `COLLUDE_SCALE` times its norm (colluders agree with each other perfectly, and their votes add up).

`--gather G` runs the loopback with a bounded fan-in (shoal.protocol.rules): at most G
contributions count a round, in the rotation every peer computes alike, whatever the claims.

`poison` also knows `topk` (DeMo): the honest coefficients and `TOPK_FACTOR` times as many per chunk,
a claim of more say than the run's k gives (a `config_mismatch`; used by tests/integration/faults.py).

Each method also runs `honest_only`: a clean run of the honest workers alone, what they reach when
every attacker is left out from the first step. Against the clean run of all workers it costs the
attackers' share of the compute; it is the floor of any defence that excludes attackers.

Reported per (method, attack): the honest worker 0's final validation loss, its change against the
clean run of the same seed, and what the honest workers' screening (shoal.peer.algorithms.robust) said of the
attackers' contributions (`opposed`: left out of a round; `outlier`: reported as persistently
opposed) and of honest ones (false reports). The loopback has no bans: this measures screening
alone, attackers stay in every round. In a swarm the reports strike their senders, and three strikes
ban them (tests/integration/test_hostile.py).
"""

import json
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

import torch

from shoal.compression import (
    DCTTopKCodec,
    DecodeLimits,
    DenseCodec,
    EncodedTensor,
    TopKCodec,
    decode_tensor,
    values,
)
from shoal.compression.dct_topk import unpack
from shoal.peer.algorithms.configs import SPARSE_OUTER, AlgorithmConfig, DeMoConfig, DiLoCoConfig
from shoal.peer.algorithms.demo import DeMo
from shoal.peer.algorithms.diloco import DiLoCo
from shoal.peer.algorithms.exchange import (
    Averaged,
    Contribution,
    Delegating,
    Exchange,
    Gathered,
    run_loopback,
)
from shoal.peer.algorithms.feedback import codec_for
from shoal.peer.bench import converge
from shoal.peer.data import BatchPlan, TokenStreams, stdlib_corpus
from shoal.peer.models.gpt import TinyGPT
from shoal.protocol import CodecId, IndexCoding, Payload, ValueEncoding

ATTACKS = ("none", "sign_flip", "sample_lie", "random", "alie", "collude")
METHODS: dict[str, AlgorithmConfig] = {
    "demo_compact": DeMoConfig(lr=converge.QUICK.demo_lr, topk=4, value_bits=1),
    "diloco_eager": DiLoCoConfig(
        mode="eager",
        lr=converge.QUICK.adamw_lr,
        inner_steps=converge.QUICK.inner_steps,
        outer_lr=converge.OUTER["eager"][0],
        outer_momentum=converge.OUTER["eager"][1],
    ),
    "diloco_sparse": DiLoCoConfig(
        lr=converge.QUICK.adamw_lr,
        inner_steps=5,  # as converge's sparse figures: 60 rounds, for error feedback and rule 4
        outer_lr=SPARSE_OUTER[0],
        outer_momentum=SPARSE_OUTER[1],
        compression="sparse",
        topk=64,
        value_bits=2,
    ),
}
"""Each method's algorithm, on the `shoal bench converge --quick` setting (DeMo there: momentum decay
0.99, weight decay 0.1; DiLoCo: converge's inner AdamW)."""
SCALE = 3.9
COLLUDE_SCALE = 2.5
"""The attacks' scale: just under the 4x-median clip that was shoal's bound before screening."""
LIED_SAMPLES = 1 << 40
TOPK_FACTOR = 4


def poison(payload: bytes, attack: str, generator: torch.Generator, scale: float | None = None) -> bytes:
    """An honest payload rewritten by `attack`, in the payload's own codec and settings (read from
    each message), so that it is as well-formed as the honest one; `scale` in place of the attack's
    own (`SCALE`, `COLLUDE_SCALE`)."""
    message = Payload.FromString(payload)
    if scale is None:
        scale = COLLUDE_SCALE if attack == "collude" else SCALE
    return Payload(
        tensors=[_poison_tensor(t, attack, generator, scale) for t in message.tensors]
    ).SerializeToString()


def _poison_tensor(
    message: EncodedTensor, attack: str, generator: torch.Generator, scale: float = SCALE
) -> EncodedTensor:
    limits = DecodeLimits(max_numel=1 << 30)
    bits = values.BITS[message.value_encoding]
    codec: DCTTopKCodec | DenseCodec
    if message.codec in (CodecId.CODEC_ID_DCT_TOPK, CodecId.CODEC_ID_TOPK):
        make = TopKCodec if message.codec == CodecId.CODEC_ID_TOPK else DCTTopKCodec
        elias_fano = message.index_coding == IndexCoding.INDEX_CODING_ELIAS_FANO
        codec = make(
            chunk=max(message.chunk_shape), topk=message.topk, value_bits=bits, elias_fano=elias_fano
        )
        coeffs = unpack(message, torch.device("cpu"), limits)
        sent = coeffs.values.float()
        if attack == "topk":
            wide = min(coeffs.topk * TOPK_FACTOR, coeffs.plan.chunk_numel)
            scores = torch.rand(coeffs.indices.shape[0], coeffs.plan.chunk_numel, generator=generator)
            scores.scatter_(1, coeffs.indices.long(), 2.0)  # the honest coefficients first
            order = scores.topk(wide, dim=1).indices
            wider = torch.randn(order.shape, generator=generator) * sent.abs().mean()
            wider[:, : coeffs.topk] = sent
            indices, position = order.sort(dim=1)
            return codec.pack(
                replace(coeffs, indices=indices, values=wider.gather(1, position)), torch.float32
            )
        if attack == "alie":
            fixed = _fixed_direction((coeffs.indices.shape[0], coeffs.plan.chunk_numel))
            along = fixed.gather(1, coeffs.indices.long())
            sent = sent + sent.norm() * along / along.norm().clamp(min=1e-30)
            return codec.pack(replace(coeffs, values=sent), torch.float32)
        if attack == "random":
            scores = torch.rand(coeffs.indices.shape[0], coeffs.plan.chunk_numel, generator=generator)
            coeffs = replace(coeffs, indices=scores.topk(coeffs.topk, dim=1).indices.sort(dim=1).values)
            noise = torch.randn(sent.shape, generator=generator)
            sent = noise * (sent.norm() / noise.norm().clamp(min=1e-30))
        else:
            sent = -sent
        return codec.pack(replace(coeffs, values=sent * scale), torch.float32)
    half = "fp16" if message.value_encoding == ValueEncoding.VALUE_ENCODING_FLOAT16 else "bf16"
    codec = DenseCodec(value_bits=bits, block=max(message.block_size, 1), half=half)
    tensor = decode_tensor(message, device="cpu", limits=limits).float()
    if attack == "alie":
        return codec.encode(tensor + tensor.norm() * _fixed_direction(tuple(tensor.shape)))
    if attack == "random":
        noise = torch.randn(tensor.shape, generator=generator)
        tensor = noise * (tensor.norm() / noise.norm().clamp(min=1e-30))
    else:
        tensor = -tensor
    return codec.encode(tensor * scale)


def _fixed_direction(shape: tuple[int, ...]) -> torch.Tensor:
    """A unit vector of `shape`, the same in every round and every attacker (seeded by the shape)."""
    seed = int.from_bytes(repr(shape).encode()[-8:].ljust(8, b"\0"), "little") % (1 << 62)
    direction = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    return direction / direction.norm()


class Collusion:
    """What colluding attackers share: each round, the first one's poisoned payload, sent by all."""

    def __init__(self, members: int):
        self._barrier = threading.Barrier(members, timeout=600)
        self._payload = b""

    def share(self, leader: bool, payload: bytes) -> bytes:
        if leader:
            self._payload = payload
        self._barrier.wait()  # the leader's payload is in
        shared = self._payload
        self._barrier.wait()  # every member has read it before the next round overwrites it
        return shared


class Poisoned(Delegating):
    """An attacker's exchange: `inner`, with the payloads and sample counts it sends rewritten."""

    def __init__(
        self, inner: Exchange, attack: str, seed: int, collusion: Collusion | None = None, leader=False
    ):
        super().__init__(inner)
        self.attack = attack
        self.generator = torch.Generator().manual_seed(seed)
        self.collusion, self.leader = collusion, leader

    def gather(self, payload: bytes, samples: int, state=None, plan=None) -> Gathered:
        samples = LIED_SAMPLES if self.attack == "sample_lie" else samples
        payload = poison(payload, self.attack, self.generator)
        if self.collusion is not None:
            payload = self.collusion.share(self.leader, payload)
        return self.inner.gather(payload, samples, state=state, plan=plan)

    def average(self, payload, samples, state, pieces, plan=None) -> Averaged:
        return Averaged.gathered(self.gather(payload, samples, state, plan))


@dataclass(slots=True)
class HostileResult:
    method: str
    attack: str
    workers: int
    attackers: int
    final_val_loss: float
    vs_clean: float | None
    """Relative change of the honest worker's loss against the clean run (0.01: 1% worse)."""
    reports_on_attackers: dict[str, int]
    """Per reason, the honest workers' reports on attackers' contributions (summed over workers)."""
    reports_on_honest: dict[str, int]
    """The same for honest contributions: false reports."""
    gather: int
    fair_share: float
    """The fewest rounds an honest worker counted in, over its fair share (G / N of the rounds; 1
    without a bounded fan-in)."""
    rounds: int
    wall_s: float


class _Recorder(Delegating):
    """An honest worker's exchange that counts, per reason, whom its optimizer reported."""

    def __init__(self, inner: Exchange, attackers: set[int]):
        super().__init__(inner)
        self.attackers = attackers
        self.on_attackers: Counter[str] = Counter()
        self.on_honest: Counter[str] = Counter()
        self.counted = 0
        """Rounds in which this worker's own contribution was among those that count."""

    def gather(self, payload: bytes, samples: int, state=None, plan=None) -> Gathered:
        result = self.inner.gather(payload, samples, state=state, plan=plan)
        self.counted += result.counted
        return result

    def reject(self, contribution: Contribution, reason: str) -> None:
        (self.on_attackers if contribution.rank in self.attackers else self.on_honest)[reason] += 1


def run(
    method: str,
    attack: str,
    workers: int,
    attackers: int,
    streams: TokenStreams,
    clean: float | None,
    gather: int = 0,
) -> HostileResult:
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; expected one of {', '.join(METHODS)}")
    algorithm = METHODS[method]
    if attack == "honest_only":
        workers, attackers, attack = workers - attackers, 0, "none"
    config = replace(converge.QUICK, workers=workers)
    torch.manual_seed(config.seed)
    initial = TinyGPT(config.gpt).state_dict()
    plan = BatchPlan(
        seq_len=config.gpt.seq_len, batch_size=config.batch_size, workers=workers, seed=config.seed
    )
    hostile = set(range(workers - attackers, workers)) if attack != "none" else set()
    collusion = Collusion(len(hostile)) if attack == "collude" else None

    def work(rank: int, loopback: Exchange):
        model = TinyGPT(config.gpt)
        model.load_state_dict(initial)
        batches = [plan.batch(streams.train, step, rank) for step in range(config.steps)]
        recorder = _Recorder(loopback, hostile)
        optimizer = _optimizer(algorithm, model, config, recorder)
        if rank in hostile:
            leader = rank == min(hostile)
            optimizer.exchange = Poisoned(loopback, attack, seed=rank, collusion=collusion, leader=leader)
        _train(optimizer, model, batches)
        return model, recorder

    start = time.perf_counter()
    # the workers stand for swarm peers: untrusted, they screen every round by default
    outcomes = run_loopback(workers, work, gather_limit=gather, trusted=False)
    wall = time.perf_counter() - start
    loss = converge.validation_loss(outcomes[0][0], streams, config)
    honest = [recorder for rank, (_, recorder) in enumerate(outcomes) if rank not in hostile]
    rounds = config.steps // algorithm.inner_steps
    share = rounds * (min(gather, workers) / workers if gather else 1.0)
    return HostileResult(
        method,
        attack,
        workers,
        len(hostile),
        loss,
        None if clean is None else loss / clean - 1,
        dict(sum((r.on_attackers for r in honest), Counter())),
        dict(sum((r.on_honest for r in honest), Counter())),
        gather,
        min(r.counted for r in honest) / share,
        rounds,
        wall,
    )


def _optimizer(
    algorithm: AlgorithmConfig, model: TinyGPT, config: converge.ConvergeConfig, exchange: Exchange
) -> DeMo | DiLoCo:
    if isinstance(algorithm, DeMoConfig):
        return DeMo(
            model.parameters(),
            lr=algorithm.lr,
            exchange=exchange,
            weight_decay=0.1,
            compression_topk=algorithm.topk,
            value_bits=algorithm.value_bits,
            compression_decay=0.99,
        )
    return DiLoCo(
        model,
        converge._adamw(model, config),  # lr: config.adamw_lr, the algorithm's
        exchange=exchange,
        inner_steps=algorithm.inner_steps,
        mode=algorithm.mode,
        outer_lr=algorithm.outer_lr,
        outer_momentum=algorithm.outer_momentum,
        codec=codec_for(algorithm) if algorithm.compression == "sparse" else None,  # else float32
        error_decay=algorithm.error_decay,
    )


def _train(optimizer, model: TinyGPT, batches) -> None:
    for inputs, targets in batches:
        model(inputs, targets=targets).backward()
        optimizer.step(samples=inputs.shape[0])
        if isinstance(optimizer, DeMo):
            optimizer.zero_grad(set_to_none=True)
    optimizer.finish()
    optimizer.close()


def main(
    *,
    as_json: bool,
    workers: int,
    attackers: int,
    methods: Sequence[str],
    attacks: Sequence[str],
    gather: int = 0,
) -> int:
    if not 0 < attackers < workers / 2:
        raise ValueError(f"--attackers must be at least 1 and fewer than half of --workers ({workers})")
    streams = stdlib_corpus()
    results = []
    for method in methods:
        clean = None
        for attack in ("none", "honest_only", *[a for a in attacks if a != "none"]):
            result = run(method, attack, workers, attackers, streams, clean, gather)
            result.attack = attack
            clean = clean or result.final_val_loss
            results.append(result)
            if not as_json:
                change = "" if result.vs_clean is None else f"{result.vs_clean:+7.1%}"
                print(
                    f"{method:<14} {attack:<11} val loss {result.final_val_loss:.4f} {change:>8}  "
                    f"on attackers {result.reports_on_attackers}  on honest {result.reports_on_honest}  "
                    f"fair share {result.fair_share:.0%}  "
                    f"{result.wall_s:5.0f} s",
                    flush=True,
                )
    if as_json:
        print(json.dumps({"results": [asdict(r) for r in results]}))
    return 0
