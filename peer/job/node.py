"""`shoal join`: one volunteer's peer, from settings to rounds in a swarm.

    settings (ports, folders: shoal.peer.config.preflight) -> device, model, data -> coordinator token
             -> identity -> DHT (print this peer's address and the join command; a joiner finds the
             round clock) -> SwarmExchange -> Trainer -> rounds until stopped

Every setting is checked before the DHT starts: one this machine cannot use (a device it lacks, a model
or data that cannot be loaded, a token the coordinator refuses) is a `SettingsError` naming the flag
(the CLI exits 2). Every other failure a volunteer can fix becomes a `JoinError` whose message says
what to do (the CLI exits 1): an unreachable bootstrap peer, no peer of the run found, a swarm whose
configuration differs, a model that does not fit the device. Ctrl-C or SIGTERM stop the
peer at the end of the round in progress, with a checkpoint when `--checkpoint-dir` is set.
With `--metrics-port` the peer serves Prometheus metrics (shoal.peer.job.metrics); with `--address-file`
it writes the address others join through, for scripts and containers.

The peer is put together by shoal.peer.job.assembly (`build_peer`), as every other peer is.
"""

import dataclasses
import re
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import IO, Any, cast

import hivemind
import torch
from hivemind.utils.crypto import RSAPrivateKey

from shoal.peer.checkpoint import CheckpointStore
from shoal.peer.config.settings import PeerSpec, SettingsError
from shoal.peer.data import validation_loss
from shoal.peer.files import replace_text
from shoal.peer.job import window
from shoal.peer.job.assembly import (
    PeerSummary,
    Workload,
    build_peer,
    fit_workload,
    load_workload,
    start_peer,
    workload_ranks,
)
from shoal.peer.job.clock import ClockError, save_clock, saved_clock
from shoal.peer.job.faults import Faults, from_environment
from shoal.peer.job.metrics import PeerMetrics, build_info
from shoal.peer.job.progress import Progress
from shoal.peer.job.round_reports import (
    tell_alone,
    tell_isolation,
    tell_late,
    tell_ledger,
    tell_resyncs,
    tell_validation,
)
from shoal.peer.job.runtime import SwarmPeer
from shoal.peer.job.window import round_seconds_for
from shoal.peer.swarm.anchor import public_key
from shoal.peer.swarm.bootstrap import BootstrapError, best_address, check_multiaddrs, private_only
from shoal.peer.swarm.coordinator_link import CoordinatorError, CoordinatorLink, check_access
from shoal.peer.swarm.exchange import Abandoned, RoundSchedule, SwarmExchange
from shoal.peer.swarm.identity import IdentityError, keygen, load_identity
from shoal.peer.swarm.membership import SHOAL_VERSION
from shoal.peer.swarm.records import RoundStatus
from shoal.peer.swarm.relay import Reachability
from shoal.peer.swarm.server import ask_runs
from shoal.peer.swarm.signing import record_key
from shoal.peer.train.fit import Fit
from shoal.peer.train.hardware import autocast_for, memory_in_use
from shoal.peer.train.ranks import LocalRanks, RanksError, serve
from shoal.peer.train.stopping import StopRequest, Watchdog, stop_on_signals
from shoal.peer.train.trainer import OutOfMemory, RoundReport, Trainer

DRAIN_MAX_S = 30.0  # the longest a leaving peer serves its last payload to peers that have not pulled it
STOP_ROUND_MARGIN_S = 5.0  # past a round's length, what a stop gives the round in flight to be exchanged


def stop_budget(round_seconds: float) -> float:
    """A stop's budget from its signal (shoal.peer.train.stopping): the round in flight ends and is
    checkpointed, then the peer serves its last payload, DRAIN_MAX_S in all, or the round's length and
    a margin where rounds are longer."""
    return max(DRAIN_MAX_S, round_seconds + STOP_ROUND_MARGIN_S)


class JoinError(RuntimeError):
    """A failure the volunteer can act on; the message says how."""


@dataclasses.dataclass(frozen=True, slots=True)
class Credentials:
    """How the peer authenticates to the coordinator and trusts it (CoordinatorLink.credentials)."""

    token: str | None
    tls_roots: bytes | None
    tls: bool
    answered: bool = False
    """Whether the coordinator answered the check at the start."""


def join(
    settings: PeerSpec, *, stream: IO[str] | None = None, faults: Faults | None = None
) -> dict[str, Any]:
    """Runs the peer until it is stopped or its rounds are done; returns the summary it printed.
    `settings` have passed shoal.peer.config.preflight.check (the CLI runs it before importing torch);
    `faults`: what the peer does wrong on purpose (None: what SHOAL_FAULTS names, usually nothing:
    shoal.peer.job.faults). Raises SettingsError for a setting checked here, JoinError for any other
    failure the volunteer can fix."""
    progress = Progress(
        settings.logging.format, stream or sys.stdout, title=f"shoal · run {settings.run.name}"
    )
    try:
        return _join(settings, progress, from_environment() if faults is None else faults)
    finally:
        progress.close()


def _join(settings: PeerSpec, progress: Progress, faults: Faults) -> dict[str, Any]:
    try:
        check_multiaddrs("--initial-peers", settings.network.initial_peers, dialable=True)
        check_multiaddrs("--announce-maddrs", settings.network.announce_maddrs, dialable=False)
    except ValueError as error:
        raise SettingsError(str(error)) from None
    # from here a signal stops the peer at a safe point (the default action would leave no checkpoint
    # and, mid-round, a DHT process behind); a stop that outlasts its budget is ended by the watchdog,
    # which first kills the DHT's processes
    stop = stop_on_signals(grace_s=DRAIN_MAX_S)
    helpers: list[Callable[[], object]] = []
    # what it returns is not read: Watchdog calls it for its effect
    watchdog = Watchdog(stop, before_exit=cast("Callable[[], None]", lambda: [kill() for kill in helpers]))
    try:
        return _join_until(settings, progress, stop, helpers, faults)
    finally:
        watchdog.cancel()


def _join_until(
    settings: PeerSpec,
    progress: Progress,
    stop: StopRequest,
    helpers: list[Callable[[], object]],
    faults: Faults,
) -> dict[str, Any]:
    workload = _workload(settings)
    fitted = None if stop.is_set() else _fit(settings, progress, workload)
    if fitted is not None and fitted.outer_on_host:
        settings = settings.changed(outer_state="cpu")
    ranks = _ranks(settings, workload)
    if ranks is not None and ranks.rank != 0:  # a rank of torchrun's other than 0: it computes for rank 0
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # ended by its launcher, or with rank 0
        autocast = autocast_for(ranks.device, settings.model.precision)
        serve(ranks, workload.model.module.to(ranks.device), workload.model.loss_fn, autocast)
        ranks.close()
        return {}
    if stop.is_set():
        _close(ranks)
        progress.message("stopped before joining: nothing trained, nothing to save")
        return {}
    try:
        credentials = _check_coordinator(settings)
        identity = _identity(settings.network.identity, progress)
        peer = start_peer(settings, identity=identity)
    except BootstrapError as error:
        _close(ranks)
        raise JoinError(str(error)) from None
    except BaseException:
        _close(ranks)
        raise
    kill_group = getattr(peer.dht, "kill_group", None)
    if kill_group is not None:
        helpers.append(kill_group)
    with peer:
        dht = peer.dht
        addresses = [str(a) for a in dht.get_visible_maddrs()]
        address = best_address(addresses)
        if settings.network.address_file:
            _write_address(settings.network.address_file, address)
        run_key = settings.network.trust_key
        if run_key is None and not settings.network.initial_peers:  # a starter's key is the run key
            run_key = public_key(record_key(identity)).hex()
        _announce_address(
            settings, progress, address, addresses, dht.peer_id.to_base58(), peer.reachability, run_key
        )
        schedule = _discover(settings, progress, dht) if settings.network.initial_peers else None
        if schedule is None and settings.network.initial_peers and settings.network.trust_key is None:
            # it joined through a bootstrap node, and started the run: its key is the run key, which the
            # join command printed first could not name yet
            run_key = public_key(record_key(identity)).hex()
            command = join_command(settings, _through(settings, address, peer.reachability), run_key)
            progress.message(
                f"this peer started run {settings.run.name!r}: others join it with\n  {command}\n"
                "(--trust-key: a joiner takes only the shared state this peer signs)"
            )
            progress.event("run_started", join_command=command, run_key=run_key)
        return _train(settings, progress, peer, schedule, workload, credentials, fitted, ranks, stop, faults)


def _discover(settings: PeerSpec, progress: Progress, dht: hivemind.DHT) -> RoundSchedule | None:
    """The round clock of the run's live peers; None if none showed up within --discover-seconds: this
    peer then starts the run (its clock starts once the model is loaded, `_train`). Peers that start
    it at the same moment end on one clock (shoal.peer.swarm.membership.winning_clock)."""
    wait = timedelta(seconds=settings.run.discover_seconds)
    try:
        return RoundSchedule.discover(dht, settings.run.name, wait)
    except TimeoutError:
        _check_other_runs(settings, progress, dht)
        progress.message(
            f"no peer of run {settings.run.name!r} found within {wait.total_seconds():g} s: starting the "
            "run. "
            "To join a running swarm instead, use the --run its join command names"
        )
        return None


def _check_other_runs(settings: PeerSpec, progress: Progress, dht: hivemind.DHT) -> None:
    """An initial peer that trains another run, when none of this one showed up, most likely means a
    mistyped --run or address: JoinError, unless the run is started at once (--discover-seconds 0), then
    a warning. The peers asked count the question (`other_run`)."""
    answers = ask_runs(dht, settings.network.initial_peers, settings.run.name)
    others = {peer: run for peer, run in answers.items() if run != settings.run.name}
    if not others:
        return
    named = ", ".join(f"peer ...{peer[-8:]} trains run {run!r}" for peer, run in others.items())
    text = (
        f"no peer of run {settings.run.name!r} showed up, and the initial peers you joined through train "
        f"another run ({named}). Check --run (to join that run: --run {next(iter(others.values()))})"
    )
    progress.event("other_run", runs=others)
    if settings.run.discover_seconds > 0:
        raise JoinError(
            f"{text}; to start run {settings.run.name!r} through them anyway: --discover-seconds 0"
        )
    progress.message(f"warning: {text}")


def _announce_address(
    settings: PeerSpec,
    progress: Progress,
    address: str,
    addresses: list[str],
    peer_id: str,
    reach: Reachability,
    run_key: str | None = None,
) -> None:
    """Every peer, the first or a joiner, says where it can be dialed, whether it can be dialed from
    outside its network, and how others join through it: once the peers a joiner came through have
    left, that is what `shoal join` and `shoal check` need. A peer behind NAT names the relay it
    joined through instead of its own address, which nobody outside its network can dial."""
    through = _through(settings, address, reach)
    command = join_command(settings, through, run_key)
    if settings.network.initial_peers:
        via = "its relay" if through != address else "this peer"
        progress.message(
            f"Joined the swarm as {address}. Others can join through {via} with:\n  {command}\n"
            f"Reachability: {reach.describe()}"
        )
    elif private_only(addresses):
        progress.message(
            f"Started a new swarm at {address}. This peer has only private or loopback addresses: only peers "
            f"on its network can join it, with:\n  {command}\nFor volunteers elsewhere, start `shoal "
            "bootstrap` on a public machine and have every peer, this one too, join through it."
        )
    else:
        progress.message(f"Started a new swarm at {address}. Others join it with:\n  {command}")
    progress.event(
        "started",
        address=address,
        join_command=command,
        initial_peers=addresses,
        peer_id=peer_id,
        reachable=reach.reachable,
        relays=list(reach.relays),
        observed=reach.observed,
        run_key=run_key,
    )


def _through(settings: PeerSpec, address: str, reach: Reachability) -> str:
    """The address others join through: this peer's own, or behind NAT, the relay it joined through."""
    if reach.reachable is False and reach.relays:
        return next(p for p in settings.network.initial_peers if p.endswith(f"/p2p/{reach.relays[0]}"))
    return address


def _workload(settings: PeerSpec) -> Workload:
    """The device, model and data the settings name (shoal.peer.job.assembly.load_workload); SettingsError
    naming the flag if one is unusable."""
    try:
        return load_workload(settings)
    except ValueError as error:  # DeviceError and ModelError are ValueErrors
        raise SettingsError(str(error)) from None


def _chosen_round(settings: PeerSpec, progress: Progress, fitted: Fit | None) -> float:
    """The round this peer starts a run with when --round-seconds is not given: one its exchange fits
    (shoal.peer.job.window.round_seconds_for), from the payload of the fit's dry run."""
    algorithm = settings.algorithm_config()
    payload = fitted.chosen.payload_bytes if fitted is not None else None
    seconds = round_seconds_for(payload, overlapped=algorithm.overlapped, gather=settings.run.gather)
    sized = f"its {payload:,}-byte payloads" if payload else "its exchange (payload unknown without --fit)"
    progress.message(
        f"starting the run with rounds of {seconds:g} s: {sized} fit a swarm of {window.PEERS} over "
        f"{window.LINK_MBIT:g} Mbit/s links, {'computing through' if algorithm.overlapped else 'idle for'} "
        "the exchange (--round-seconds chooses another)"
    )
    return seconds


def _fit(settings: PeerSpec, progress: Progress, workload: Workload) -> Fit | None:
    """--fit auto: what fits this device (shoal.peer.train.fit), said with its numbers; a device too slow
    for the round's window is warned of (it joins, late); SettingsError when nothing fits in memory."""
    try:
        fitted = fit_workload(settings, workload)
    except ValueError as error:  # FitError, or a model whose activations cannot be recomputed
        raise SettingsError(str(error)) from None
    if fitted is not None:
        progress.message(fitted.describe())
        progress.event("fit", **fitted.record())
        if fitted.late:
            progress.message(f"warning: {fitted.lateness()}")
    return fitted


def _ranks(settings: PeerSpec, workload: Workload) -> LocalRanks | None:
    try:
        return workload_ranks(settings, workload)
    except RanksError as error:
        raise SettingsError(str(error)) from None


def _close(ranks: LocalRanks | None) -> None:
    if ranks is not None:
        ranks.close()


def _train(
    settings: PeerSpec,
    progress: Progress,
    peer: SwarmPeer,
    schedule: RoundSchedule | None,
    workload: Workload,
    credentials: Credentials | None,
    fitted: Fit | None,
    ranks: LocalRanks | None,
    stop: StopRequest,
    faults: Faults,
) -> dict[str, Any]:
    starts = schedule is None
    if schedule is None:
        schedule = saved_clock(settings, progress) or RoundSchedule(
            start_time=settings.run.start_time or time.time() + 0.5,
            round_seconds=settings.run.round_seconds or _chosen_round(settings, progress, fitted),
        )
    settings = settings.changed(round_seconds=schedule.round_seconds)  # the swarm's, not this peer's flag
    # the others may still be pulling this peer's last payload when it leaves: it serves it for up to a
    # round more
    peer.drain = timedelta(seconds=min(DRAIN_MAX_S, schedule.round_seconds))
    stop.grace_s = stop_budget(schedule.round_seconds)
    _save_clock(settings, schedule)
    trainer = build_peer(
        peer,
        settings,
        schedule,
        workload,
        coordinator=_coordinator_link(settings, credentials, peer.dht.peer_id.to_base58()),
        warn=lambda text: progress.message(f"warning: {text}"),
        faults=faults,
        ranks=ranks,
        starts_run=starts,  # (this peer's key is the run key: shoal.peer.swarm.anchor)
    )
    assert peer.exchange is not None  # build_peer connected it (SwarmPeer.connect)
    if fitted is not None:
        trainer.batch_size = fitted.batch_size
        trainer.expect_pace(fitted.chosen.round_s / trainer.inner_steps)
    if settings.network.initial_peers:
        _check_compatible(peer.exchange)
    numel = workload.model.parameters
    metrics = _serve_metrics(settings, progress, peer.exchange, trainer, workload.device, numel)
    try:
        if trainer.resume():
            assert trainer.checkpoints is not None  # resume() loads only from a checkpoint store
            progress.message(f"resumed from the checkpoint of round {trainer.checkpoints.loaded_round}")
        else:
            peer.exchange.at_genesis()
        data = workload.streams
        progress.message(
            f"training {settings.model.name} ({numel:,} parameters) with {settings.algorithm.name} on "
            f"{workload.device}, data {data.name} ({len(data.train):,} training tokens, tokenizer "
            f"{data.tokenizer}); rounds of {schedule.round_seconds:g} s"
        )
        return _loop(settings, progress, peer, workload, metrics, stop)
    except Abandoned as error:  # not stopping: the DHT's process died under the peer
        code = getattr(peer.dht, "exitcode", None)
        raise JoinError(f"{error} (exit code {code}): the peer cannot go on without it") from None
    except OutOfMemory as error:
        raise JoinError(str(error)) from None
    except CoordinatorError as error:  # it refused the token it accepted at the start, or never answered
        raise SettingsError(str(error)) from None
    finally:
        if metrics is not None:
            metrics.close()


def _save_clock(settings: PeerSpec, schedule: RoundSchedule) -> None:
    try:
        save_clock(settings, schedule)
    except ClockError as error:
        raise JoinError(str(error)) from None


def _loop(
    settings: PeerSpec,
    progress: Progress,
    peer: SwarmPeer,
    workload: Workload,
    metrics: PeerMetrics | None,
    stop: StopRequest,
) -> dict[str, Any]:
    # _train built the peer (build_peer), connected and trained, and set the swarm's --round-seconds
    exchange, reports = cast(SwarmExchange, peer.exchange), []
    adopted = 0  # round clocks taken from peers that started the run at once
    isolated = alone = False
    crowd = 1  # the most participants of a round so far
    told = -1  # the last round the token ledger settled, as logged
    late = (0, 0)  # (rounds missed so far, of them in a row)
    resyncing = 0  # rounds in a row re-synced
    last_status: RoundStatus | None = None  # the round before's
    senders = [exchange.owner.hex(), exchange.peer_id.encode().hex()]  # this peer, as ledger events name it
    for done in peer.rounds(
        until_round=settings.run.until_round, max_rounds=settings.run.max_rounds, stop=stop
    ):
        report, status = done.report, done.status
        reports.append(report)
        crowd = max(crowd, report.participants)
        if (crowd > 1 and report.participants <= 1) != alone:
            alone = not alone
            tell_alone(progress, alone, report, status.peers_seen)
        late = tell_late(progress, status.late, late, report, cast(float, settings.run.round_seconds))
        resyncing = tell_resyncs(progress, status, last_status, resyncing, report)
        last_status = status
        if status.isolated != isolated:
            isolated = status.isolated
            tell_isolation(progress, isolated, report.round, peer.reachability)
        if metrics is not None:
            metrics.observe_round(
                report,
                wall_s=done.wall_s,
                payload_bytes=status.payload_bytes,
                peers_seen=status.peers_seen,
                stragglers=status.stragglers,
                shared=status.shared,
            )
        progress.round(
            {
                "round": report.round,
                "loss": report.loss,
                "tokens_per_s": report.tokens / max(done.wall_s, 1e-9),
                "participants": report.participants,
                "shared": status.shared,
                "together": f"{peer.together}/{len(reports)}",
                "micro_batches": f"{report.micro_batches}x{report.batch_size}",
                "bytes_up": done.bytes_up,
                "bytes_down": done.bytes_down,
                "round_s": done.wall_s,
                "epoch": None if status.ledger is None else status.ledger.epochs,
            },
            samples=report.samples,
            tokens=report.tokens,
            phases=report.phases,
            lr=report.lr,
            round_seconds=status.round_seconds,
        )
        told = tell_ledger(progress, cast(Trainer, peer.trainer).ledger, senders, done.plan, metrics, told)
        tell_validation(
            settings, progress, workload, cast(Trainer, peer.trainer).batch_size, report.round, metrics
        )
        if status.clocks_adopted > adopted:  # a restart keeps the run's clock, not the one it left
            adopted = status.clocks_adopted
            _save_clock(settings, exchange.schedule)
    # the swarm's run ends together (not this peer alone: a stop, or its own --max-rounds)
    alone = bool(settings.run.max_rounds and len(reports) >= settings.run.max_rounds)
    final_resync = peer.finish(until_round=settings.run.until_round, left_alone=alone)
    if reports and not peer.stopped:  # the run's last state, after its end agreed (a stop saved already)
        cast(Trainer, peer.trainer).save()
    loaded, batch_size = workload.model, cast(Trainer, peer.trainer).batch_size
    held_out = (loaded.module, loaded.loss_fn, workload.streams.validation, loaded.seq_len)
    # a stop past its budget (or a second signal) leaves at once: no validation pass
    measure = reports and not (peer.abandoned or stop.spent())
    validation = validation_loss(*held_out, batch_size=batch_size) if measure else None
    return _summary(settings, progress, peer, reports, final_resync, validation)


def _serve_metrics(
    settings: PeerSpec,
    progress: Progress,
    exchange: SwarmExchange,
    trainer: Trainer,
    device: torch.device,
    numel: int,
) -> PeerMetrics | None:
    """With --metrics-port: Prometheus metrics on --host:port/metrics (shoal.peer.job.metrics)."""
    if settings.logging.metrics_port is None:
        return None
    info = build_info(
        version=SHOAL_VERSION,
        torch_version=torch.__version__,
        device=str(device),
        algorithm=settings.algorithm.name,
        model=settings.model.name,
        run=settings.run.name,
        peer_id=exchange.peer_id,
    )
    metrics = PeerMetrics(info=info, dense_bytes=4 * numel)
    metrics.track_exchange(exchange.counters)
    metrics.track_device_memory(memory_in_use(device))
    if trainer.checkpoints is not None:  # and so in the lambda: the trainer keeps its store
        metrics.track_checkpoints(
            trainer.checkpoints.last_saved, lambda: cast(CheckpointStore, trainer.checkpoints).write_failures
        )
    try:
        port = metrics.serve(settings.network.host, settings.logging.metrics_port)
    except OSError as error:
        raise JoinError(
            f"cannot serve metrics on {settings.network.host}:{settings.logging.metrics_port} "
            f"({error.strerror}): choose "
            "another --metrics-port, or 0 for any free one"
        ) from None
    shown = "127.0.0.1" if settings.network.host == "0.0.0.0" else settings.network.host
    progress.event("metrics", address=f"{shown}:{port}", port=port)
    progress.message(f"Prometheus metrics on http://{shown}:{port}/metrics")
    return metrics


def _write_address(path: str, address: str) -> None:
    """--address-file: the join address, written whole."""
    try:
        replace_text(path, address + "\n")
    except OSError as error:
        raise JoinError(f"--address-file {path}: {error.strerror}") from None


def _summary(
    settings: PeerSpec,
    progress: Progress,
    peer: SwarmPeer,
    reports: Sequence[RoundReport],
    final_resync: bool,
    validation: float | None,
) -> dict[str, Any]:
    """The run as this peer saw it (shoal.peer.job.assembly.PeerSummary), logged as the `summary` event
    (and, for a person, one line)."""
    summary = PeerSummary.of(peer, reports, validation=validation, final_resync=final_resync)
    event = summary.event()
    progress.event("summary", **event)
    if settings.logging.format == "human":
        progress.message(summary.line())
    return event


def _check_coordinator(settings: PeerSpec) -> Credentials | None:
    """With --coordinator: its credentials, and that it accepts this peer's token (if it can be reached
    now: else the peer trains uncoordinated until it can); SettingsError naming the flag to fix."""
    if settings.coordinator.address is None:
        return None
    try:
        credentials = Credentials(
            *CoordinatorLink.credentials(settings.coordinator.token_file, settings.coordinator.ca)
        )
        answered = check_access(
            settings.coordinator.address,
            token=credentials.token,
            tls_roots=credentials.tls_roots,
            tls=credentials.tls,
        )
    except CoordinatorError as error:
        raise SettingsError(str(error)) from None
    return dataclasses.replace(credentials, answered=answered)


def _coordinator_link(
    settings: PeerSpec, credentials: Credentials | None, peer_id: str
) -> CoordinatorLink | None:
    if credentials is None:  # no --coordinator
        return None
    return CoordinatorLink(
        cast(str, settings.coordinator.address),  # set: credentials come with --coordinator
        peer_id,
        token=credentials.token,
        tls_roots=credentials.tls_roots,
        tls=credentials.tls,
        first_contact_s=settings.coordinator.wait,
        answered=credentials.answered,
    )


def join_command(settings: PeerSpec, address: str, run_key: str | None = None) -> str:
    """The command that joins another peer to this one's run: the run, the model and the algorithm, then
    every setting the run configuration pins (`PeerSpec.run_config`, the one list peers compare) where
    it differs from that algorithm's default, as the configuration spells it (a schedule's rounds that
    `--until-round` implied are named outright), and the run key a joiner trusts for its first state
    (shoal.peer.swarm.anchor), if there is one. The corpus is not named: a joiner brings its own copy."""
    parts = ["shoal", "join", "--initial-peers", address]
    model, algorithm = settings.flag("model"), settings.flag("algorithm")
    parts += ["--run", str(settings.flag("run")), "--model", str(model), "--algorithm", str(algorithm)]
    defaults = PeerSpec.of(model=model, algorithm=algorithm).run_config()
    for key, value in settings.run_config().items():
        if key not in ("model", "algorithm", "data", "tokenizer") and defaults.get(key) != value:
            parts += config_flag(key, value)
    for name in ("compression", "topk", "value_bits", "chunk"):  # a codec's defaults follow --compression
        flag = "--" + name.replace("_", "-")
        if settings.flag(name) is not None and flag not in parts:
            parts += [flag, str(settings.flag(name))]
    if run_key is not None:
        parts += ["--trust-key", run_key]
    return " ".join(parts)


def _identity(path: str | None, progress: Progress) -> RSAPrivateKey:
    if path is None:
        return RSAPrivateKey()
    try:
        if not Path(path).exists():
            progress.message(f"created a new peer identity in {path}")
            return keygen(path)
        return load_identity(path)
    except IdentityError as error:
        raise SettingsError(f"--identity {path}: {error}") from None


def _check_compatible(exchange: SwarmExchange) -> None:
    """Refuses to train alone next to a swarm of another configuration, or next to one that follows a
    coordinator (coordinated peers announce their payloads only to it)."""
    # from every replica: a node nearest the key that hides records could otherwise keep newcomers out
    compatible = exchange.compatible_peers(fully=True)
    # most of them, so that one peer lying in its record cannot keep newcomers out
    coordinators = exchange.coordinators_seen
    if exchange.coordinator is None and 2 * len(coordinators) > len(compatible) - 1:
        addresses = ", ".join(sorted(set(coordinators.values())))
        raise JoinError(
            f"the peers of this run follow a coordinator (they reach it as {addresses}): "
            "pass --coordinator HOST:PORT"
        )
    if len(compatible) == 1 and exchange.refused:
        said = Counter(in_flags(reason) for reason in exchange.refused.values())
        reasons = "\n".join(f"  {text} ({count} peer{'s' * (count > 1)})" for text, count in said.items())
        raise SettingsError(
            "every peer of this run has another configuration; set what differs as they do (or use the join "
            f"command their first peer printed):\n{reasons}"
        )


# the run configuration's keys (shoal.peer.config.spec run_config) that are not spelled as their flag
CONFIG_FLAGS = {"compression_topk": "--topk", "total_rounds": "--until-round"}


def config_flag(key: str, value: str) -> list[str]:
    """A run configuration's entry as the flag and value that set it: `total_rounds` 21 is
    `--until-round 20` (the last round's number)."""
    if key == "total_rounds" and value.isdigit():
        value = str(int(value) - 1)
    return [CONFIG_FLAGS.get(key, "--" + key.replace("_", "-")), value]


def in_flags(reason: str) -> str:
    """A peer's refusal (shoal.peer.swarm.membership.incompatibility: "topk is 4 there, 32 here; ...")
    in the flags a volunteer sets: "--topk 4 in the run, 32 here"; a corpus by its digests' first
    digits, said as a corpus."""
    parts = []
    for part in reason.split("; "):
        found = re.fullmatch(r"(\w+) is (.+) there, (.+) here", part)
        if found is None:
            parts.append(part)
            continue
        key, theirs, mine = found.groups()
        theirs, mine = (v.replace("the default", "its default") for v in (theirs, mine))
        if key == "data":
            parts.append(
                f"--data: the run trains on another corpus (digest {theirs[:12]} there, {mine[:12]} here)"
            )
        elif key == "tokenizer":
            parts.append(f"--tokenizer: the run's corpus was tokenized by {theirs}, yours by {mine}")
        else:
            flag, theirs = config_flag(key, theirs)
            mine = config_flag(key, mine)[1]
            parts.append(f"{flag} {theirs} in the run, {mine} here")
    return "; ".join(parts)
