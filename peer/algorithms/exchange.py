"""The narrow interface through which DeMo and DiLoCo talk to the other participants of a round.

An exchange does two things, both collective (every participant of the round calls them in the same
order):

- `gather(payload, samples, state)`: every participant's serialized payload and sample count, in rank
  order (the same order on every participant, so that aggregation is deterministic);
- `mean(tensor, weight)`: the weighted mean of a dense tensor over the participants;
- `average(payload, samples, state, pieces)`: `gather` for dense payloads, which an exchange may
  average piece by piece instead (the swarm under a coordinator: shoal.peer.algorithms.butterfly).

A round's result is a value, `Gathered`: the contributions in rank order, and what else the round
decided for this participant. Two parts of it only the swarm fills (its members are not trusted to
agree): `state` is this participant's shared state at the start of the round (parameters, outer
momentum), and an exchange that compares states returns in `adopted` the round's majority state when
this one's differed, for the caller to load before it applies the round; a bounded fan-in says in
`counted` whether this participant's payload was among those that count. `reject(contribution,
reason)` tells the exchange the caller dropped a contribution, so that it can strike its sender.

Implementations: `LoopbackExchange` (N workers as threads of one process: tests and simulations),
`TorchDistributedExchange` (torch.distributed: gloo on CPU, nccl on GPU, for torchrun users), and the
hivemind swarm (`shoal.peer.swarm.exchange.SwarmExchange`). Payloads are bytes (serialized protobuf): never
pickled, and their size is what really crosses the wire. The first two are `trusted`: over them DeMo and
DiLoCo default to the reference semantics (`robust.NONE`, nothing screened); over the swarm they screen
every round (shoal.peer.algorithms.robust). An explicit `robust=` wins either way.
"""

import math
import struct
import threading
import time
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import TYPE_CHECKING, Protocol, TypeVar

import torch
import torch.distributed as dist

from shoal.compression import DecodeLimits, DenseCodec, decode_tensor
from shoal.protocol import EncodedTensor, MalformedPayloadError, parse_message
from shoal.protocol.rules import choose

if TYPE_CHECKING:
    from shoal.peer.algorithms.butterfly import Pieces

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Contribution:
    """One participant's payload for a round."""

    rank: int
    payload: bytes
    samples: int
    sender: bytes = b""
    """Who sent it, for exchanges that tell senders apart (the swarm: its public key)."""
    round: int = -1
    """The round it was sent for, for exchanges that number rounds (the swarm); -1: unnumbered."""


Replay = Callable[
    [list[torch.Tensor], list[Contribution], tuple[int, int]], "tuple[list[torch.Tensor], list[bytes]] | None"
]
"""replay(shared state, a round's contributions in rank order, (that round, the round the result
starts)) -> (the shared state after the round, as the optimizer computes it when it takes part, on new
tensors; the senders whose contributions it rejected), or None if it cannot replay that round; the
state handed in is left as it is. (DeMo's step reads the learning rate of both rounds.)"""


@dataclass(frozen=True, slots=True)
class Gathered(Sequence[Contribution]):
    """What a round's `gather` returns: its contributions, in rank order (it is a sequence of them),
    and what else the round decided for this participant."""

    contributions: tuple[Contribution, ...] = ()
    adopted: list[torch.Tensor] | None = None
    """The majority's shared state, when this participant's differed: the caller loads it before it
    applies the round. None when it agreed or nothing was compared."""
    counted: bool = True
    """Whether this participant's payload was among the round's contributions. Only a bounded fan-in
    (shoal.protocol.rules) leaves it out, and the optimizer then keeps its work for its next one."""
    round: int = -1
    """The round's number, for exchanges that number rounds (the swarm); -1: unnumbered."""

    def __len__(self) -> int:
        return len(self.contributions)

    def __getitem__(self, index):
        return self.contributions[index]

    def __iter__(self):
        return iter(self.contributions)

    def only(self, contributions) -> "Gathered":
        """The same round with other contributions (a wrapper that leaves some out, or adds some)."""
        return replace(self, contributions=tuple(contributions))


@dataclass(frozen=True, slots=True)
class Averaged:
    """What `Exchange.average` returns: either the round's contributions, for the caller to average as
    after `gather`, or the mean itself, averaged by the exchange piece by piece
    (shoal.peer.algorithms.butterfly)."""

    contributions: Gathered | None = None
    pieces: list[list[torch.Tensor]] | None = None
    """Per piece, in order, its decoded slice of every tensor (`Pieces.assemble` joins them)."""
    samples: int = 0
    """With `pieces`: the samples of the participants averaged."""
    clipped: int = 0
    """With `pieces`: parts scaled down by their owners (this peer's own piece, and any it averaged)."""
    adopted: list[torch.Tensor] | None = None
    """As `Gathered.adopted`."""
    counted: bool = True
    """As `Gathered.counted`."""

    @staticmethod
    def gathered(result: Gathered) -> "Averaged":
        """A round that was gathered, not averaged piece by piece."""
        return Averaged(contributions=result, adopted=result.adopted, counted=result.counted)


class Plan(Protocol):
    """The round a payload was computed for, as its caller planned it (a swarm peer's RoundPlan:
    shoal.peer.swarm.records). The trainer hands it through the optimizer to the exchange with the
    round's payload, so that an overlapped optimizer's gather on another thread takes its own round's
    plan; exchanges that plan no rounds ignore it, and batches read their data slot from it."""

    @property
    def round(self) -> int: ...


class Exchange(ABC):
    """What an optimizer needs from the network."""

    gather_limit: int = 0
    """At most this many contributions count in a round (a bounded fan-in: shoal.protocol.rules);
    0: all of them."""
    last_round: int | None = None
    """The round of the last `gather`, where the exchange numbers rounds (the swarm's clock); None:
    it numbers none, or gathered nothing yet. A checkpoint is labelled with it."""
    trusted: bool = False
    """Whether its participants are trusted not to attack each other (one process's threads, the ranks
    of one torch.distributed job): DeMo and DiLoCo then default to the reference semantics,
    `robust.NONE`, instead of screening each round (`robust.default_for`). The swarm's are not."""

    @property
    @abstractmethod
    def rank(self) -> int:
        """This participant's position in the deterministic order."""

    @property
    @abstractmethod
    def world_size(self) -> int:
        """How many participants take part in each collective."""

    @abstractmethod
    def gather(
        self,
        payload: bytes,
        samples: int,
        state: Sequence[torch.Tensor] | None = None,
        plan: Plan | None = None,
    ) -> Gathered:
        """Every participant's payload (this one's included), ordered by rank, and what else the round
        decided for this participant (`Gathered`).

        `state`: this participant's shared state at the start of the round (see the module docstring);
        exchanges that do not compare states ignore it. `plan`: the round the payload was computed
        for, as the caller planned it (the swarm: `SwarmExchange.plan_round`'s RoundPlan), passed in
        with the payload, so that an overlapped optimizer's gather on another thread takes its own
        round's plan; exchanges that do not plan rounds ignore it."""

    def average(
        self,
        payload: bytes,
        samples: int,
        state: Sequence[torch.Tensor] | None,
        pieces: "Pieces",
        plan: Plan | None = None,
    ) -> Averaged:
        """Like `gather`, for a dense payload that `pieces` (shoal.peer.algorithms.butterfly) can cut: an
        exchange that can average it piece by piece returns the mean; others (this default) the
        contributions."""
        return Averaged.gathered(self.gather(payload, samples, state, plan))

    def replays_with(self, replay: "Replay") -> None:
        """How the caller applies a round to a shared state it is handed (`Replay`): an exchange that
        compares states may rebuild the majority's that way, for a participant a few rounds behind
        (shoal.peer.swarm.replay). This default, for exchanges that compare none, ignores it."""
        return None

    def reject(self, contribution: Contribution, reason: str) -> None:
        """The caller dropped `contribution` of the last gather (malformed, or an outlier)."""
        return None

    def refuse(self, reason: str) -> None:
        """The caller refused something of its own, not a contribution (this participant's update, or a
        round's aggregate, with non-finite values): counted under `reason`, nobody struck."""
        return None

    @abstractmethod
    def mean(self, tensor: torch.Tensor, weight: float = 1.0) -> torch.Tensor:
        """sum_m weight_m * tensor_m / sum_m weight_m over the participants, as a new tensor."""


class Delegating(Exchange):
    """An exchange that passes everything to `inner`: benchmarks subclass it to count or change what
    they need (shoal.peer.bench: bytes sent, a hostile worker's payloads)."""

    def __init__(self, inner: Exchange):
        self.inner = inner

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def world_size(self) -> int:
        return self.inner.world_size

    # read-only here, the inner exchange's, where Exchange's is a plain attribute: an override mypy refuses
    @property
    def gather_limit(self) -> int:  # type: ignore[override]
        return self.inner.gather_limit

    @property
    def trusted(self) -> bool:  # type: ignore[override]  # the inner exchange's, as gather_limit
        return self.inner.trusted

    def gather(
        self,
        payload: bytes,
        samples: int,
        state: Sequence[torch.Tensor] | None = None,
        plan: Plan | None = None,
    ) -> Gathered:
        return self.inner.gather(payload, samples, state, plan)

    def reject(self, contribution: Contribution, reason: str) -> None:
        self.inner.reject(contribution, reason)

    def refuse(self, reason: str) -> None:
        self.inner.refuse(reason)

    def mean(self, tensor: torch.Tensor, weight: float = 1.0) -> torch.Tensor:
        return self.inner.mean(tensor, weight)


class LoopbackExchange(Exchange):
    """N workers inside one process, each on its own thread, meeting at a barrier.

    Create the group with `LoopbackExchange.group(n)` and give worker i the i-th exchange. Every
    collective waits at most `timeout` for the others, so a worker that died fails the rest loudly
    instead of hanging them.
    """

    def __init__(self, hub: "_LoopbackHub", rank: int, gather_limit: int = 0, trusted: bool = True):
        self._hub = hub
        self._rank = rank
        self.gather_limit = gather_limit
        """At most this many contributions count in a `gather` (shoal.protocol.rules); 0: all."""
        self.trusted = trusted
        """True (the default): the workers are trusted, DeMo and DiLoCo do not screen by default; a
        simulation of the swarm (`shoal bench converge`, `shoal bench hostile`) passes False."""
        self.sent_bytes = 0
        """The size of this worker's last payload."""
        self._round = 0

    @staticmethod
    def group(
        world_size: int,
        *,
        timeout: timedelta = timedelta(seconds=60),
        latency: timedelta = timedelta(0),
        gather_limit: int = 0,
        trusted: bool = True,
    ) -> list["LoopbackExchange"]:
        """`world_size` exchanges meeting in this process. `latency` is added to every collective, to
        simulate a slow link; `gather_limit` bounds the contributions that count in a round, as the
        swarm's `--gather` does (shoal.protocol.rules); `trusted=False` has DeMo and DiLoCo screen
        each round by default, as swarm peers do (`Exchange.trusted`)."""
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if gather_limit < 0:
            raise ValueError(f"gather_limit must be >= 0, got {gather_limit}")
        hub = _LoopbackHub(world_size, timeout, latency)
        return [LoopbackExchange(hub, rank, gather_limit, trusted) for rank in range(world_size)]

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._hub.world_size

    def gather(
        self,
        payload: bytes,
        samples: int,
        state: Sequence[torch.Tensor] | None = None,
        plan: Plan | None = None,
    ) -> Gathered:
        self.sent_bytes = len(payload)
        everyone = self._hub.all_gather(self._rank, Contribution(self._rank, bytes(payload), samples))
        self._round += 1
        chosen = choose(
            b"loopback", self._round, [c.rank.to_bytes(4, "little") for c in everyone], self.gather_limit
        )
        return Gathered(
            tuple(c for c in everyone if c.rank.to_bytes(4, "little") in chosen),
            counted=self._rank.to_bytes(4, "little") in chosen,
            round=self._round - 1,
        )

    def abort(self) -> None:
        """Breaks the group's barrier: every worker waiting in a collective raises at once."""
        self._hub.abort()

    def mean(self, tensor: torch.Tensor, weight: float = 1.0) -> torch.Tensor:
        entries = self._hub.all_gather(self._rank, (tensor.detach().clone(), float(weight)))
        total = sum(w for _, w in entries)
        result = torch.zeros_like(tensor)
        for value, w in entries:  # rank order: the same float sum on every worker
            result.add_(value * (w / total))  # rounded, then added: the same bits on every device
        return result


def mean_by_gather(
    exchange: Exchange, tensor: torch.Tensor, weight: float, rejected: Counter[str]
) -> torch.Tensor:
    """`mean` for an exchange that moves only bytes (the swarm): every participant gathers the others'
    tensors at float32 with their weights; a malformed one is left out, its reason counted in
    `rejected`."""
    message = DenseCodec(32, zstd=False).encode(tensor.detach().float().cpu()).SerializeToString()
    contributions = exchange.gather(struct.pack("<d", weight) + message, samples=0)
    limits = DecodeLimits(max_numel=max(tensor.numel(), 1))
    total, result = 0.0, torch.zeros_like(tensor, dtype=torch.float32)
    for contribution in contributions:  # rank order: the same float sums everywhere
        try:
            other_weight, other = _weighted_tensor(contribution.payload, tensor.shape, limits)
        except MalformedPayloadError as error:
            rejected[error.reason] += 1
            continue
        result.add_(other.to(result.device) * other_weight)  # not fused: the same bits on every device
        total += other_weight
    return (result / max(total, 1e-30)).to(tensor.dtype)


def _weighted_tensor(data: bytes, shape: torch.Size, limits: DecodeLimits) -> tuple[float, torch.Tensor]:
    if len(data) < 8:
        raise MalformedPayloadError("unparsable", "mean contribution shorter than its weight")
    (weight,) = struct.unpack("<d", data[:8])
    if not (math.isfinite(weight) and weight >= 0):
        raise MalformedPayloadError("bad_samples", f"weight {weight}")
    message = parse_message(EncodedTensor, data[8:], max_bytes=len(data))
    tensor = decode_tensor(message, limits=limits)
    if tensor.shape != shape:
        raise MalformedPayloadError("wrong_structure", f"shape {list(tensor.shape)}, expected {list(shape)}")
    return weight, tensor


def run_loopback(
    count: int,
    work: Callable[[int, "LoopbackExchange"], T],
    *,
    timeout: timedelta = timedelta(minutes=10),
    latency: timedelta = timedelta(0),
    gather_limit: int = 0,
    trusted: bool = True,
) -> list[T]:
    """Runs work(rank, exchange) for `count` loopback workers, one thread each; results in rank order.

    A worker that raises breaks the others' barrier, so they stop too, and its exception is raised here.
    `latency`, `gather_limit` and `trusted` go to `LoopbackExchange.group`.
    """
    exchanges = LoopbackExchange.group(
        count, timeout=timeout, latency=latency, gather_limit=gather_limit, trusted=trusted
    )
    results: list = [None] * count
    errors: list[BaseException] = []

    def target(rank: int) -> None:
        try:
            results[rank] = work(rank, exchanges[rank])
        except BaseException as error:
            errors.append(error)
            exchanges[rank].abort()

    threads = [threading.Thread(target=target, args=(rank,), daemon=True) for rank in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout.total_seconds())
    if errors:
        raise errors[0]
    if any(thread.is_alive() for thread in threads):
        raise TimeoutError(f"loopback workers still running after {timeout}")
    return results


class _LoopbackHub:
    """The shared slots and barrier of one LoopbackExchange group."""

    def __init__(self, world_size: int, timeout: timedelta, latency: timedelta):
        self.world_size = world_size
        self._timeout_s = timeout.total_seconds()
        self._latency_s = latency.total_seconds()
        self._barrier = threading.Barrier(world_size)
        self._slots: list[object] = [None] * world_size

    def abort(self) -> None:
        self._barrier.abort()

    def all_gather(self, rank: int, item: object) -> list:
        if self._latency_s:
            time.sleep(self._latency_s)
        self._slots[rank] = item
        self._barrier.wait(self._timeout_s)  # everyone has written
        items = list(self._slots)
        self._barrier.wait(self._timeout_s)  # everyone has read: slots may be reused
        return items


class TorchDistributedExchange(Exchange):
    """torch.distributed collectives over an initialized process group (gloo or nccl).

    Payload bytes travel as uint8 tensors: one all_gather of the lengths, one of the payloads padded
    to the longest. On nccl the tensors live on `device` (the current CUDA device). The ranks of one
    job are trusted: DeMo and DiLoCo default to the reference semantics over it (`Exchange.trusted`).
    """

    trusted = True

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        *,
        max_payload_bytes: int = 1 << 30,
    ):
        if not dist.is_initialized():
            raise RuntimeError("TorchDistributedExchange needs torch.distributed.init_process_group() first")
        self._group = group
        backend = dist.get_backend(group)
        if device is None:
            device = (
                torch.device("cuda", torch.cuda.current_device())
                if backend == "nccl"
                else torch.device("cpu")
            )
        self._device = torch.device(device)
        self._max_payload_bytes = max_payload_bytes

    @property
    def rank(self) -> int:
        return dist.get_rank(self._group)

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self._group)

    def gather(
        self,
        payload: bytes,
        samples: int,
        state: Sequence[torch.Tensor] | None = None,
        plan: Plan | None = None,
    ) -> Gathered:
        header = torch.tensor([len(payload), samples], dtype=torch.int64, device=self._device)
        headers = [torch.empty_like(header) for _ in range(self.world_size)]
        dist.all_gather(headers, header, group=self._group)
        sizes = [(int(h[0]), int(h[1])) for h in headers]
        longest = max(size for size, _ in sizes)
        if longest > self._max_payload_bytes or min(min(h) for h in sizes) < 0:
            raise RuntimeError(
                f"a participant announced a {longest}-byte payload (limit {self._max_payload_bytes}) "
                "or a negative size or sample count"
            )
        mine = torch.zeros(longest, dtype=torch.uint8, device=self._device)
        if payload:
            mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        buffers = [
            torch.empty(longest, dtype=torch.uint8, device=self._device) for _ in range(self.world_size)
        ]
        dist.all_gather(buffers, mine, group=self._group)
        return Gathered(
            tuple(
                Contribution(rank, buffer[:size].cpu().numpy().tobytes(), samples)
                for rank, (buffer, (size, samples)) in enumerate(zip(buffers, sizes, strict=True))
            )
        )

    def mean(self, tensor: torch.Tensor, weight: float = 1.0) -> torch.Tensor:
        weighted = tensor.detach().to(self._device) * weight
        total = torch.tensor([float(weight)], dtype=torch.float64, device=self._device)
        dist.all_reduce(weighted, group=self._group)
        dist.all_reduce(total, group=self._group)
        return (weighted / total.to(weighted.dtype)).to(tensor.device)
