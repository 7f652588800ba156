"""A swarm peer driven round after round (`SwarmPeer`): its DHT, its `SwarmExchange` and its `Trainer`
(shoal.peer.train.trainer), closed in order. shoal.peer.job.assembly puts it together from a `PeerSpec`.
"""

import dataclasses
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, cast

import hivemind
from hivemind.utils.crypto import RSAPrivateKey
from torch import nn

from shoal.peer.algorithms.configs import AlgorithmConfig
from shoal.peer.job.window import AutoWindow
from shoal.peer.swarm.bootstrap import start_dht
from shoal.peer.swarm.exchange import Abandoned, SwarmExchange
from shoal.peer.swarm.membership import record_validators
from shoal.peer.swarm.records import RoundPlan, RoundSchedule, RoundStatus, SharedLedger
from shoal.peer.swarm.relay import UNCHECKED, check_reachability
from shoal.peer.train.stopping import StopRequest
from shoal.peer.train.trainer import Batches, RoundReport, Trainer


@dataclass(frozen=True, slots=True)
class PeerRound:
    """One round of a swarm peer's loop (`SwarmPeer.rounds`)."""

    report: RoundReport
    plan: RoundPlan
    wall_s: float
    """The whole round on this peer: waiting for its plan, computing, exchanging."""
    plan_s: float
    """Waiting for the plan (under a coordinator: its next round)."""
    bytes_up: int
    """Payload and state bytes this peer served during the round."""
    bytes_down: int
    status: RoundStatus
    """Where the exchange stood once the round was done (the job reads nothing else of it)."""


class SwarmPeer:
    """One peer of a swarm, and the one round loop that drives it. `shoal join` (shoal.peer.job.node), the
    benchmark workers and the integration tests' peers all run through it, built by
    shoal.peer.job.assembly (`start_peer`, then `build_peer`, which call these):

        with SwarmPeer.start("my-run", initial_peers, host_maddrs=["/ip4/0.0.0.0/tcp/0"]) as peer:
            peer.connect(schedule, config)                # its SwarmExchange
            peer.train(model, algorithm, batches)         # its Trainer
            for done in peer.rounds(until_round=100, stop=stop_on_signals()):
                ...                                       # report, metrics
            peer.finish(until_round=100)                  # the last round applied, the run's end agreed

    Each round's plan (`SwarmExchange.plan_round`) goes to the trainer as a value: its batches read
    their data slot and seed there, and the optimizer hands it to the exchange with the round's
    payload. Closing the peer closes the trainer, then the exchange (serving its last payload for at
    most `drain` to peers that have not pulled it), then the DHT.
    """

    def __init__(self, dht: hivemind.DHT, identity: RSAPrivateKey, run: str):
        self.dht, self.identity, self.run = dht, identity, run
        self.exchange: SwarmExchange | None = None
        self.ledger: SharedLedger | None = None
        """The run's token ledger (shoal.peer.data.ledger), if it keeps one: each plan gets its lane."""
        self.trainer: Trainer | None = None
        self.stopped = False
        """Whether the loop ended on a stop (a signal): the peer leaves alone, after a checkpoint."""
        self.together = 0
        """Rounds in which this peer's payload counted together with another peer's (`shared`)."""
        self.abandoned = False
        """Whether the stop gave up a round in flight (its time spent, or a second signal): no new
        checkpoint, the last complete one stands."""
        self.drain = timedelta(0)
        self.reachability = UNCHECKED
        """Whether this peer can be dialed, and its relays (shoal.peer.swarm.relay)."""
        self._encode_s = 0.0  # the last round's encode time
        self.window: AutoWindow | None = None
        """Without --compute-fraction: each uncoordinated round computes until its deadline, less the
        exchange time measured (shoal.peer.job.window)."""

    @classmethod
    def start(
        cls,
        run: str,
        initial_peers: Sequence[str],
        *,
        host_maddrs: Sequence[str],
        identity: RSAPrivateKey | None = None,
        relay: bool = True,
        **dht_options: Any,
    ) -> "SwarmPeer":
        """Joins the DHT through `initial_peers` (none: a new swarm), with the run's record validators;
        `dht_options` go to `bootstrap.start_dht` (identity_path, ...); asks the relays among them whether
        this peer can be dialed (`reachability`). `relay` False: no relay, shoal's or libp2p's circuit
        relay (`shoal join --relay off`). Raises BootstrapError."""
        identity = identity or RSAPrivateKey()
        validators = record_validators(run, identity)
        if not relay:
            dht_options["use_relay"] = False
        dht = start_dht(initial_peers, host_maddrs=host_maddrs, record_validators=validators, **dht_options)
        peer = cls(dht, identity, run)
        try:
            peer.reachability = check_reachability(dht, initial_peers)
            if not relay:
                peer.reachability = dataclasses.replace(peer.reachability, relays=(), relaying=False)
        except BaseException:
            dht.shutdown()
            raise
        return peer

    def connect(
        self,
        schedule: RoundSchedule,
        config: Mapping[str, str],
        *,
        exchange_type: type[SwarmExchange] = SwarmExchange,
        **options: Any,
    ) -> SwarmExchange:
        """This peer's exchange on `schedule`, for the run configuration `config`; `options` go to
        SwarmExchange (a test's hostile peer passes its subclass as `exchange_type`)."""
        options.setdefault("reachability", self.reachability)
        self.ledger = options.get("tokens")
        self.exchange = exchange_type(
            self.dht, run=self.run, schedule=schedule, identity=self.identity, config=config, **options
        )
        return self.exchange

    def train(
        self, model: nn.Module, algorithm: AlgorithmConfig, batches: Batches, **options: Any
    ) -> Trainer:
        """This peer's trainer over its exchange; `options` go to Trainer."""
        # connected first (`connect`: the class docstring)
        self.trainer = Trainer(
            model, cast(SwarmExchange, self.exchange), algorithm=algorithm, batches=batches, **options
        )
        return self.trainer

    def rounds(
        self,
        *,
        until_round: int | None = None,
        max_rounds: int | None = None,
        stop: StopRequest | None = None,
        planned: Callable[[RoundPlan], None] | None = None,
    ) -> Iterator[PeerRound]:
        """Trains round after round, each for the round the exchange plans (`plan_round`), until the run
        is past `until_round`, `max_rounds` are done, or `stop` is set (the round in progress ends,
        with a checkpoint; `stopped` is then set). `planned(plan)` is called before each round's
        computation starts."""
        # connected and trained first (`connect`, `train`: the class docstring)
        exchange, trainer = cast(SwarmExchange, self.exchange), cast(Trainer, self.trainer)
        exchange.stop = trainer.stop = stop  # its waits end with the stop's budget
        count = samples = 0
        while not (max_rounds and count >= max_rounds):
            if until_round is not None and self._past(until_round):
                return
            if stop is not None and stop.is_set() and count == 0:  # stopped before its first round
                self.stopped = True
                return
            before, started = exchange.status(), time.perf_counter()
            try:
                plan = exchange.plan_round(until_round)
            except Abandoned:
                if stop is None or not stop.is_set():
                    raise
                self.stopped = True  # stopped between rounds: the last round's checkpoint stands
                return
            if plan is None or (until_round is not None and plan.round > until_round):
                return
            plan_s = time.perf_counter() - started
            if self.ledger is not None:  # its lane of the token ledger (shoal.peer.data.ledger)
                plan = dataclasses.replace(plan, lane=self.ledger.lane(plan.round, *plan.slot))
            if planned is not None:
                planned(plan)
            if plan.compute_seconds is not None and trainer.compute_window is not None:
                # a trainer that fills a window fills the coordinator's, leaving time to encode before its
                # deadline (one that computes one micro-batch per step keeps to that)
                trainer.set_compute_window(plan.compute_seconds - self._encode_s - 0.2)
            elif self.window is not None and trainer.compute_window is not None:
                deadline = exchange.schedule.deadline(plan.round)
                trainer.set_compute_window(self.window.seconds(deadline, time.time()))
            # the round it computed for: an overlapped optimizer's gather may not have started yet
            try:
                report = trainer.round(plan.round, plan=plan)
            except Abandoned:
                if stop is None or not stop.is_set():
                    raise
                # the round's exchange outlasted the stop (or a second signal came): its state is
                # half-stepped, so the last complete checkpoint stands
                self.stopped = self.abandoned = True
                return
            stopping = stop is not None and stop.is_set()  # read once: a stop after the checkpoint
            trainer.end_round(stopping)  # waits for the next round's end, which then saves it
            self._encode_s = report.phases["encode"]
            status = exchange.status()
            self.together += status.shared
            if self.window is not None and plan.compute_seconds is None:
                self.window.observe(status.needed, self._encode_s)
            wall = time.perf_counter() - started
            count, samples = count + 1, samples + report.samples
            ledger = status.ledger
            exchange.set_progress(
                throughput=report.samples / max(wall, 1e-9),
                samples=samples,
                compute_throughput=report.samples / max(report.compute_s, 1e-9),
                min_samples=trainer.batch_size * trainer.inner_steps,
                epoch=0.0 if ledger is None else ledger.epochs,
                tokens=0 if ledger is None else ledger.tokens,
            )
            up = status.bytes_sent - before.bytes_sent
            down = status.bytes_received - before.bytes_received
            yield PeerRound(report, plan, wall, plan_s, up, down, status)
            if stopping:
                self.stopped = True
                return

    def finish(self, *, until_round: int | None = None, left_alone: bool = False) -> bool:
        """Ends training: unless stopped, the round still in flight is applied; and when the swarm's run
        ends together after `until_round` (this peer is not leaving alone, on its own round limit or a
        stop), the peers agree on the state they end on (SwarmExchange.agree_final), and this one takes
        the majority's if it differs. Returns whether it did."""
        # connected and trained first (`connect`, `train`: the class docstring)
        if not self.stopped:
            cast(Trainer, self.trainer).finish()
        if until_round is None or left_alone or self.stopped:
            return False
        adopted = cast(SwarmExchange, self.exchange).agree_final(
            until_round, cast(Trainer, self.trainer).shared_state()
        )
        if adopted is not None:
            cast(Trainer, self.trainer).load_shared_state(adopted)
        return adopted is not None

    def _past(self, until_round: int) -> bool:
        """Whether the peer is done with round `until_round` (or, on the clock alone, past it). A peer
        with a coordinator it has not tried yet is past nothing on the clock: the coordinator's first
        round waits for its peers, so a peer slower to start than the run's `--start-time` plus its
        rounds (a loaded machine) would otherwise leave at once, having trained nothing."""
        exchange = cast(SwarmExchange, self.exchange)  # connected first (`rounds`)
        if exchange.last_round is not None and exchange.last_round >= until_round:
            return True
        link = exchange.coordinator
        uncoordinated = link is None or (link.started and not link.connected)
        return uncoordinated and exchange.next_round > until_round

    def close(self) -> None:
        try:
            if self.trainer is not None:
                self.trainer.close()
        finally:
            try:
                if self.exchange is not None:
                    # the DHT's daemon ends next: removing the handlers first would only tell every peer
                    self.exchange.close(drain=self.drain, unregister=False)
            finally:
                self.dht.shutdown()

    def __enter__(self) -> "SwarmPeer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
