"""The one recipe that puts a peer together from its `PeerSpec`, and the one summary of its run.

    workload = load_workload(spec)                    # device, model, data: checked before the DHT starts
    with start_peer(spec) as peer:                    # its DHT (shoal.peer.job.runtime.SwarmPeer)
        build_peer(peer, spec, schedule, workload)    # its SwarmExchange and Trainer
        reports = [done.report for done in peer.rounds(until_round=spec.run.until_round)]
        peer.finish()
        summary = PeerSummary.of(peer, reports)

`shoal join` (shoal.peer.job.node), `shoal bench swarm-local` and `wan`, and the integration tests' peers
all assemble through here. They change fields of the spec (`spec.changed(...)`), and pass only what a
spec cannot hold: a benchmark's own model or batches, a test's hostile exchange class, a deadline.
"""

import hashlib
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from hivemind.utils.crypto import RSAPrivateKey

from shoal.peer.algorithms.configs import DeMoConfig, DiLoCoConfig
from shoal.peer.algorithms.feedback import codec_for
from shoal.peer.algorithms.robust import finite
from shoal.peer.checkpoint import CheckpointStore
from shoal.peer.config.spec import MOST_MICRO_BATCHES, PeerSpec
from shoal.peer.data import RoundSlices, TokenStreams, load_data
from shoal.peer.data.ledger import Lane, TokenLedger
from shoal.peer.data.tokenizer import load_tokenizer
from shoal.peer.job.faults import NO_FAULTS, Faults
from shoal.peer.job.runtime import SwarmPeer
from shoal.peer.job.window import AutoWindow
from shoal.peer.models.loading import LoadedModel, load_model, recompute, recomputing
from shoal.peer.swarm.coordinator_link import CoordinatorLink
from shoal.peer.swarm.exchange import SwarmExchange
from shoal.peer.swarm.records import RoundPlan, RoundSchedule
from shoal.peer.train.fit import Fit, fit
from shoal.peer.train.hardware import LossScale, autocast_for, choose_device
from shoal.peer.train.ranks import LocalRanks, RanksError, check_ranks, start_ranks, torchrun_ranks
from shoal.peer.train.trainer import Batches, RoundReport, Trainer


@dataclass(frozen=True, slots=True)
class Workload:
    """What the peer trains on and with."""

    device: torch.device
    model: LoadedModel
    streams: TokenStreams


def load_workload(spec: PeerSpec) -> Workload:
    """The device, model and data the spec names, the model built on the CPU (it moves to the device in
    `build_peer`, once the DHT's process is forked). ValueError (DeviceError, ModelError) naming the
    flag when one cannot be used, or when the data holds tokens the model cannot read."""
    device = choose_device(spec.model.device)
    loaded = load_model(spec.model.name, seed=spec.run.seed, seq_len=spec.model.seq_len)
    if spec.model.activation_checkpointing == "on":
        checkpoint_activations(loaded.module, spec.model.name)
    autocast_for(device, spec.model.precision)  # a precision this device lacks, named before the DHT starts
    data = spec.data
    tokenizer = load_tokenizer(data.tokenizer, spec.model.name)
    cache = Path(data.cache) if data.cache else None
    own = Path(spec.model.name)
    bare = str(own) if tokenizer is None and own.is_dir() and not (own / "tokenizer.json").is_file() else None
    streams = load_data(
        data.source,
        tokenizer=tokenizer,
        text_field=data.text_field,
        cache=cache,
        model_without_tokenizer=bare,
    )
    if loaded.vocab_size is not None and streams.vocab_size > loaded.vocab_size:
        raise ValueError(
            f"--data {data.source} has token ids up to {streams.vocab_size - 1} (tokenizer "
            f"{streams.tokenizer}), but --model {spec.model.name} reads only {loaded.vocab_size} distinct "
            "tokens: give the model's own tokenizer (--tokenizer), or a model of its vocabulary"
        )
    return Workload(device, loaded, streams)


def fit_workload(spec: PeerSpec, workload: Workload) -> Fit | None:
    """`--fit auto`: the micro-batch, activation checkpointing and DiLoCo's outer-state placement that
    fit this device in memory and the round's compute window (shoal.peer.train.fit: estimated, then measured
    by a dry run), checkpointing switched on if chosen (the caller sets --outer-state cpu if chosen:
    `Fit.outer_on_host`); None with `--fit off`. FitError (a ValueError) when nothing fits."""
    if spec.model.fit == "off":
        return None
    model, on = workload.model, spec.model.activation_checkpointing == "on"
    result = fit(
        model,
        spec.algorithm_config(),
        device=workload.device,
        batch_size=spec.model.batch_size,
        window_s=spec.run.window_s,
        checkpointing=on,
        outer_on_host=spec.model.outer_state == "cpu",
        max_memory_gib=spec.model.max_memory,
        autocast=autocast_for(workload.device, spec.model.precision),
        name=f"--model {spec.model.name}",
    )
    if result.checkpointing and not on:
        checkpoint_activations(model.module, spec.model.name)
    return result


def workload_ranks(spec: PeerSpec, workload: Workload) -> LocalRanks | None:
    """`--nproc-per-node N` (the other ranks spawned, each building the spec's model) or torchrun: this
    process's place among the peer's data-parallel ranks (shoal.peer.train.ranks), the group met; None for
    one process. RanksError naming the flag when this machine has fewer devices than ranks."""
    ranks = torchrun_ranks(workload.device)
    if ranks is not None or spec.model.nproc_per_node == 1:
        return ranks
    check_ranks(spec.model.nproc_per_node, workload.device)
    if spec.model.max_micro_batches < spec.model.nproc_per_node:
        raise RanksError(
            f"--nproc-per-node {spec.model.nproc_per_node}: each rank computes at least one micro-batch a "
            f"step, and --max-micro-batches is {spec.model.max_micro_batches}: raise it to at least the ranks"
        )
    model = {
        "name": spec.model.name,
        "seed": spec.run.seed,
        "seq_len": spec.model.seq_len,
        "checkpointing": bool(recomputing(workload.model.module)),
        "precision": spec.model.precision,
    }
    return start_ranks(spec.model.nproc_per_node, workload.device, model)


def checkpoint_activations(module: torch.nn.Module, name: str) -> None:
    """`--activation-checkpointing on`: the embedded GPT's blocks, or a Hugging Face model's own
    gradient checkpointing; ValueError naming the flag for a model that has neither."""
    if recomputing(module) is None:
        raise ValueError(f"--activation-checkpointing on: --model {name} has no way to recompute activations")
    recompute(module, True)


def start_peer(spec: PeerSpec, *, identity: RSAPrivateKey | None = None) -> SwarmPeer:
    """The peer's DHT on the spec's network settings (host, port, initial peers, relay, announced
    addresses, identity file); raises BootstrapError."""
    network = spec.network
    return SwarmPeer.start(
        spec.run.name,
        network.initial_peers,
        host_maddrs=[f"/ip4/{network.host}/tcp/{network.port}"],
        identity=identity,
        identity_path=network.identity,
        relay=network.relay == "on",
        **({"announce_maddrs": list(network.announce_maddrs)} if network.announce_maddrs else {}),
    )


def build_peer(
    peer: SwarmPeer,
    spec: PeerSpec,
    schedule: RoundSchedule,
    workload: Workload,
    *,
    coordinator: CoordinatorLink | None = None,
    batches: Batches | None = None,
    fill_window: bool = True,
    warn: Callable[[str], None] | None = None,
    faults: Faults = NO_FAULTS,
    ranks: LocalRanks | None = None,
    **exchange_options: Any,
) -> Trainer:
    """Connects the peer's exchange on `schedule` and its trainer, as the spec says, and returns the
    trainer (also `peer.trainer`). `batches`: the benchmark's own (default: the round's windows of the
    spec's data, `round_batches`); `fill_window` False computes one micro-batch per step instead of
    filling --compute-fraction of each round; `warn` hears of checkpoints that could not be written;
    `ranks`: the peer's data-parallel ranks, this one rank 0 (shoal.peer.train.ranks); `faults`: what it
    does wrong on purpose (shoal.peer.job.faults: a test's); `exchange_options` override SwarmExchange's
    (a test's fetch timeout or strike limit)."""
    device, loaded = workload.device, workload.model
    model = loaded.module.to(device)
    numel = loaded.parameters
    options: dict[str, Any] = {  # SwarmExchange's keywords
        "coordinator": coordinator,
        "device": str(device),
        "max_payload_bytes": max(1 << 20, 8 * numel),
        "rejoin": spec.network.initial_peers,
        "gather_limit": spec.run.gather,
        "trust_key": None if spec.network.trust_key is None else bytes.fromhex(spec.network.trust_key),
        "starts_run": not spec.network.initial_peers,
    }
    config = spec.run_config(data=workload.streams)
    tokens = token_ledger(spec, workload) if batches is None else None
    if tokens is not None:
        options["tokens"] = tokens
        config["ledger"] = tokens.describe()
    peer.connect(schedule, config, exchange_type=faults.exchange_type, **(options | exchange_options))
    algorithm = spec.algorithm_config()
    meta = {
        "model": spec.model.name,
        "seq_len": workload.model.seq_len,
        "run": spec.run.name,
        "run_config": dict(config),
        "tokenizer": spec.data.tokenizer or "",
    }
    store = CheckpointStore(spec.checkpoint.dir, warn=warn, meta=meta) if spec.checkpoint.dir else None
    if fill_window and spec.run.compute_fraction is None:
        peer.window = AutoWindow(schedule.round_seconds)
    return peer.train(
        model,
        algorithm,
        batches or round_batches(spec, workload, tokens, delay_s=faults.compute_delay_s),
        codec=codec_for(algorithm) if isinstance(algorithm, DiLoCoConfig) else None,
        checkpoints=store,
        checkpoint_every=spec.checkpoint.every,
        loss_fn=loaded.loss_fn,
        batch_size=spec.model.batch_size,
        compute_window=spec.run.window_s if fill_window else None,
        max_micro_batches=spec.model.max_micro_batches,
        autocast=autocast_for(device, spec.model.precision),
        ledger=tokens,
        schedule=spec.schedule(),
        grad_clip=spec.algorithm.grad_clip,
        weight_decay=spec.algorithm.weight_decay,
        outer_device="cpu" if spec.model.outer_state == "cpu" else None,
        ranks=ranks,
        loss_scale=LossScale() if spec.model.precision == "fp16" else None,
    )


def token_ledger(spec: PeerSpec, workload: Workload) -> TokenLedger | None:
    """The run's token ledger over the training stream (shoal.peer.data.ledger); None under butterfly
    averaging, whose rounds keep the per-round draw of RoundSlices."""
    algorithm = spec.algorithm_config()
    if isinstance(algorithm, DiLoCoConfig) and algorithm.averaging == "butterfly":
        return None
    late = algorithm.overlapped if isinstance(algorithm, DeMoConfig) else algorithm.mode != "standard"
    stride = spec.model.batch_size
    return TokenLedger(
        workload.streams.train.windows(workload.model.seq_len + 1),
        stride,
        seed=spec.run.seed,
        lag=1 if late else 0,  # an overlapped optimizer applies a round a round later
        most_places=stride * MOST_MICRO_BATCHES * algorithm.inner_steps,  # whatever this peer's cap
        seq_len=workload.model.seq_len,
    )


def round_batches(
    spec: PeerSpec, workload: Workload, tokens: TokenLedger | None = None, *, delay_s: float = 0.0
) -> Batches:
    """A swarm peer's batches: with the token ledger, the round's micro-batches from this peer's lane
    of it (shoal.peer.data.ledger); without, in round r the peer in slot s of the round's peers trains
    on its own windows of the training stream (shoal.peer.data.RoundSlices), DiLoCo's inner steps of
    one round on successive micro-batch slots. `delay_s` (a slow peer's fault: shoal.peer.job.faults)
    is slept before each round's first one; `--audit-data on` keeps what each lane trained
    (`Lane.audit`)."""
    slices = RoundSlices(seq_len=workload.model.seq_len, stride=spec.model.batch_size, seed=spec.run.seed)
    train, device, delay = workload.streams.train, workload.device, delay_s
    most, inner_steps = spec.model.max_micro_batches, spec.algorithm_config().inner_steps
    window, audit = workload.model.seq_len + 1, spec.data.audit == "on"

    def batches(step: int, micro: int, size: int, plan: RoundPlan) -> tuple[torch.Tensor, torch.Tensor]:
        place, places = plan.slot
        inner = step % inner_steps
        if delay and inner == 0 and micro == 0:
            time.sleep(delay)  # a slow peer, on purpose (shoal.peer.job.faults)
        lane = cast("Lane | None", plan.lane)  # the token ledger's (TokenLedger.lane: SwarmPeer.rounds)
        if lane is not None:
            if audit and lane.audit is None:
                lane.audit = {}
            # a lane comes only with the token ledger, `tokens` (build_peer)
            rows = train.rows(cast(TokenLedger, tokens).batch(lane, step, micro, size)[0], window)
            inputs, targets = rows[:, :-1], rows[:, 1:]
        else:
            inputs, targets = slices.batch(
                train,
                round_number=plan.round,
                slot=place,
                slots=places,
                micro=inner * most + micro,
                batch_size=size,
                seed=plan.data_seed,
            )
        return inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)

    return cast(Batches, batches)  # the trainer hands a swarm peer's batches its RoundPlan


def param_hash(model: torch.nn.Module) -> str:
    """SHA-256 of the parameters' bytes, in order: equal on peers that hold one model."""
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().cpu().numpy().tobytes())
    return digest.hexdigest()


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerSummary:
    """A peer's run as it saw it: what `shoal join` logs as its `summary` event (`event()`), and what
    the benchmarks and tests read of a peer."""

    round_numbers: tuple[int, ...]
    losses: tuple[float, ...]
    """Each round's training loss."""
    participants: tuple[int, ...]
    compute_seconds: tuple[float, ...]
    validation_loss: float | None
    """On held-out data, when the caller measured it."""
    param_hash: str
    finite: bool
    """Whether every parameter is finite."""
    payload_bytes: float
    """Mean payload bytes this peer sent a round."""
    counts: dict[str, Any]
    """What the exchange and the trainer counted (`COUNTED`), by the summary event's names."""
    round_clock: tuple[float, float]
    """The clock the peer ended on: (start time, round seconds)."""
    final_resync: bool
    """Whether the peer took the majority's state at the run's end (SwarmPeer.finish)."""
    stopped: bool
    """Whether a stop (a signal) ended the run."""
    checkpoint: str | None
    """The folder of the checkpoint written on the stop, if one was."""

    @classmethod
    def of(
        cls,
        peer: SwarmPeer,
        reports: Sequence[RoundReport],
        *,
        validation: float | None = None,
        final_resync: bool = False,
    ) -> "PeerSummary":
        # a built peer (build_peer): connected and trained
        exchange, trainer = cast(SwarmExchange, peer.exchange), cast(Trainer, peer.trainer)
        store = trainer.checkpoints
        return cls(
            round_numbers=tuple(r.round for r in reports),
            losses=tuple(r.loss for r in reports),
            participants=tuple(r.participants for r in reports),
            compute_seconds=tuple(r.compute_s for r in reports),
            validation_loss=validation,
            param_hash=param_hash(trainer.model),
            finite=finite(list(trainer.model.parameters())),
            payload_bytes=trainer.sync.bytes_sent / max(1, len(reports)),
            counts=_counted(exchange, trainer, peer.together),
            round_clock=(exchange.schedule.start_time, exchange.schedule.round_seconds),
            final_resync=final_resync,
            stopped=peer.stopped,
            checkpoint=str(store.directory)
            if peer.stopped and not peer.abandoned and store and not store.last_write_failed
            else None,
        )

    @property
    def rounds(self) -> int:
        return len(self.round_numbers)

    def event(self) -> dict[str, Any]:
        """The summary as `shoal join` logs it: one flat object, without the per-round lists."""
        first, last = (0, -1) if self.rounds else (None, None)
        return {
            "rounds": self.rounds,
            "first_round": None if first is None else self.round_numbers[first],
            "last_round": None if last is None else self.round_numbers[last],
            "initial_loss": None if first is None else self.losses[first],
            "final_loss": None if last is None else self.losses[last],
            "validation_loss": self.validation_loss,
            "param_hash": self.param_hash,
            "finite": self.finite,
            "payload_bytes": self.payload_bytes,
            "median_compute_s": statistics.median(self.compute_seconds) if self.rounds else None,
            **self.counts,
            "round_clock": list(self.round_clock),
            "final_resync": self.final_resync,
            "stopped": self.stopped,
            "checkpoint": self.checkpoint,
        }

    def line(self) -> str:
        """The run in one line, for a person."""
        ending = "stopped" + (", checkpoint saved" if self.checkpoint else "") if self.stopped else "done"
        if not self.rounds:
            return f"{ending}: no round finished"
        validation = "" if self.validation_loss is None else f", validation loss {self.validation_loss:.4f}"
        losses = f"loss {self.losses[0]:.4f} -> {self.losses[-1]:.4f}"
        # the hash two volunteers compare to know they hold one model
        return f"{ending}: {self.rounds} rounds, {losses}{validation}, parameters {self.param_hash}"


def _counted(exchange: SwarmExchange, trainer: Trainer, peer_together: int) -> dict[str, Any]:
    """The counters of a peer's summary, by the names its event gives them."""
    counts = exchange.counts
    return {
        "bytes_sent": counts.bytes_sent,
        "bytes_received": counts.bytes_received,
        "via_relay": dict(counts.via_relay),
        "dht_stores": counts.dht_stores,
        # rounds in which this peer's payload counted with another's: its work reached the swarm
        "trained_together": peer_together,
        "resyncs": counts.resyncs,
        "resync_bytes": counts.received["state"],
        # states rebuilt by replaying the steps since one this peer held, and the bytes pulled for them
        "replays": counts.replays,
        "replay_bytes": counts.replay_bytes,
        "replayed_state_bytes": counts.replayed_state_bytes,  # what downloads would have pulled instead
        "coordinated_rounds": counts.coordinated_rounds,
        "butterfly_rounds": counts.butterfly_rounds,
        "pieces_recomputed": counts.pieces_recomputed,
        "clocks_adopted": counts.clocks_adopted,
        "late_rounds": counts.late,
        "left_out_rounds": counts.left_out,
        # this peer's payload not counted: a bounded fan-in left it out, or the others refused it
        "uncounted_rounds": trainer.sync.uncounted,
        "isolated_rounds": exchange.isolation.rounds,
        "steps_cut_short": trainer.cut_short,
        # refused contributions by reason: by the exchange (fetch, record, ban) and by the algorithm,
        # which reports each one it drops to the exchange (Exchange.reject)
        "rejected": dict(counts.rejected),
        "banned": len(exchange.banned),
    }
