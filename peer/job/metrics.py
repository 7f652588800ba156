"""A peer's Prometheus metrics, on `/metrics` of `shoal join --metrics-port N`.

Names follow Prometheus' conventions: the `shoal_` prefix, base units in the name (`_seconds`,
`_bytes`), `_total` on counters. Labels stay low-cardinality: a phase, a kind of traffic, a rejection
reason (a fixed set named in the code); no peer ids on per-round series. Which peer a series comes from
is the scrape target's `instance` label; `shoal_build_info` carries the peer id once, for a table.

Two sources:
- what one round did (`observe_round`, called by the round loop): round, loss, tokens and samples,
  tokens/s, phase durations, compression ratio, participants, peers seen, stragglers;
- the exchange's running counters, read when Prometheus scrapes (`SwarmCollector`): bytes by kind,
  rejections by reason, strikes, bans, re-syncs, late and coordinated rounds.
"""

import math
import platform
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:  # torch: not loaded for the metrics alone
    from shoal.peer.train.trainer import RoundReport

# Every reason a peer's input is dropped for (shoal.protocol's MalformedPayloadError reasons and the
# swarm's own), exposed at 0 from the start so that a healthy peer has the series too (a test checks
# that the code raises no other reason)
REJECTION_REASONS = (
    "aggregate_non_finite", "bad_announcement", "bad_block", "bad_request", "bad_chunk", "bad_dtype",
    "bad_indices", "bad_index_bits",
    "bad_index_coding", "bad_manifest", "bad_record", "bad_samples", "bad_scale", "bad_shape", "bad_steps",
    "bad_topk",
    "bad_zstd", "banned", "channel_request", "channels", "config_mismatch", "digest_mismatch",
    "duplicate", "false_reachable", "length_mismatch", "missing", "non_finite", "opposed", "other_run",
    "outlier", "overclaim", "own_non_finite", "probe_rate", "replay_mismatch", "replay_unavailable",
    "replayed", "resync_failed", "stale_state", "too_large", "unknown_codec", "unknown_value_encoding",
    "unparsable", "unserved",
    "value_out_of_range", "wrong_structure",
)  # fmt: skip
PHASE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
ROUND_BUCKETS = (0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800)


class PeerMetrics:
    """The metrics of one `shoal join` process, in a registry of their own."""

    def __init__(self, *, info: dict[str, str], dense_bytes: int):
        """`info`: the build_info labels (version, torch, device, ...); `dense_bytes`: the size of one
        fp32 copy of the parameters, what a data-parallel peer would send per step (the compression
        ratio's numerator)."""
        self.registry = r = CollectorRegistry()
        self.dense_bytes = dense_bytes
        Info("shoal_build", "Versions, device and run of this peer (value 1).", registry=r).info(info)
        self.round = Gauge("shoal_round", "The swarm round this peer finished last.", registry=r)
        self.rounds = Counter("shoal_rounds", "Rounds this peer finished.", registry=r)
        self.rounds_together = Counter(
            "shoal_rounds_trained_together",
            "Rounds in which this peer's payload counted together with another peer's.",
            registry=r,
        )
        self.loss = Gauge("shoal_training_loss", "Mean training loss of the last round.", registry=r)
        self.validation_loss = Gauge(
            "shoal_validation_loss",
            "Loss on the held-out batches at the last validation (--validate-every; the same batches on "
            "every peer).",
            registry=r,
        )
        self.tokens = Counter("shoal_tokens", "Target tokens trained on.", registry=r)
        self.samples = Counter("shoal_samples", "Samples (sequences) trained on.", registry=r)
        self.tokens_per_second = Gauge(
            "shoal_tokens_per_second", "Tokens of the last round over its wall time.", registry=r
        )
        self.phase = Histogram(
            "shoal_round_phase_duration_seconds",
            "Time per round phase: compute, encode, exchange, decode, apply.",
            ["phase"],
            buckets=PHASE_BUCKETS,
            registry=r,
        )
        self.round_duration = Histogram(
            "shoal_round_duration_seconds",
            "Wall time of a round on this peer.",
            buckets=ROUND_BUCKETS,
            registry=r,
        )
        self.compression_ratio = Gauge(
            "shoal_compression_ratio",
            "fp32 size of the parameters over this peer's payload in the last round.",
            registry=r,
        )
        self.payload_bytes = Gauge(
            "shoal_payload_bytes", "Size of this peer's payload in the last round.", registry=r
        )
        self.participants = Gauge(
            "shoal_round_participants", "Contributions aggregated in the last round.", registry=r
        )
        self.peers_seen = Gauge(
            "shoal_peers_seen",
            "Peers expected in the last round (by the coordinator, or seen), this one included.",
            registry=r,
        )
        self.round_stragglers = Gauge(
            "shoal_round_stragglers", "Expected peers whose payload missed the last round.", registry=r
        )
        self._data_gauges(r)

    def observe_round(
        self,
        report: "RoundReport",
        *,
        wall_s: float,
        payload_bytes: int,
        peers_seen: int,
        stragglers: int,
        shared: bool = False,
    ) -> None:
        """One finished round: `report` is the trainer's RoundReport (shoal.peer.train.trainer); `shared`:
        whether this peer's payload counted together with another's."""
        self.round.set(report.round)
        self.rounds.inc()
        if shared:
            self.rounds_together.inc()
        if math.isfinite(report.loss):
            self.loss.set(report.loss)
        self.tokens.inc(report.tokens)
        self.samples.inc(report.samples)
        self.tokens_per_second.set(report.tokens / max(wall_s, 1e-9))
        for phase, seconds in report.phases.items():
            self.phase.labels(phase=phase).observe(max(seconds, 0.0))
        self.round_duration.observe(max(wall_s, 0.0))
        if payload_bytes > 0:
            self.payload_bytes.set(payload_bytes)
            self.compression_ratio.set(self.dense_bytes / payload_bytes)
        self.participants.set(report.participants)
        self.peers_seen.set(peers_seen)
        self.round_stragglers.set(stragglers)

    def _data_gauges(self, r: CollectorRegistry) -> None:
        self.data_epoch = Gauge(
            "shoal_data_epoch", "The swarm's epoch over the training data (its token ledger).", registry=r
        )
        self.data_epoch_progress = Gauge(
            "shoal_data_epoch_progress",
            "Share of the epoch's training windows the swarm has consumed (its token ledger), 0 to 1.",
            registry=r,
        )
        self.data_tokens_consumed = Gauge(
            "shoal_data_tokens_consumed",
            "Target tokens the swarm has consumed since the run began, each window once an epoch (its "
            "token ledger: windows whose payload counted).",
            registry=r,
        )

    def observe_ledger(self, epoch: int, progress: float, tokens: int) -> None:
        """The token ledger's standing (shoal.peer.data.ledger.TokenLedger.progress)."""
        self.data_epoch.set(epoch)
        self.data_epoch_progress.set(progress)
        self.data_tokens_consumed.set(tokens)

    def track_device_memory(self, used_bytes: Callable[[], float]) -> None:
        Gauge(
            "shoal_device_memory_used_bytes",
            "Memory in use on the training device (CUDA/MPS: tensors allocated; CPU: resident set).",
            registry=self.registry,
        ).set_function(used_bytes)

    def track_checkpoints(
        self, last_saved: Callable[[], float | None], write_failures: Callable[[], int]
    ) -> None:
        """`last_saved`: unix time of the newest checkpoint, None before the first; `write_failures`:
        checkpoints that could not be written (the peer trained on)."""

        def age() -> float:
            saved = last_saved()
            return math.nan if saved is None else max(0.0, time.time() - saved)

        Gauge(
            "shoal_checkpoint_age_seconds",
            "Seconds since the newest checkpoint was written (NaN before the first).",
            registry=self.registry,
        ).set_function(age)
        self.registry.register(CheckpointCollector(write_failures))

    def track_exchange(self, counters: Callable[[], dict[str, Any]]) -> None:
        self.registry.register(SwarmCollector(counters))

    def serve(self, host: str, port: int) -> int:
        """Serves `/metrics` on host:port in a daemon thread; returns the port (port 0: any free one).
        Raises OSError if it cannot listen."""
        self._server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return self._server.server_port

    def close(self) -> None:
        server = getattr(self, "_server", None)
        if server is not None:
            server.shutdown()
            server.server_close()


# (name, type, help, key of SwarmExchange.counters())
SCALARS = (
    ("shoal_strikes", "counter", "Strikes given to misbehaving peers.", "strikes"),
    ("shoal_banned_peers", "gauge", "Peers whose announcements are ignored now.", "banned"),
    ("shoal_refused_peers", "gauge", "Peers of the run refused for another configuration.", "refused"),
    ("shoal_state_resyncs", "counter", "Times this peer downloaded the majority's state.", "resyncs"),
    ("shoal_state_replays", "counter", "Times this peer rebuilt the majority's state by replay.", "replays"),
    ("shoal_state_replay_bytes", "counter", "Bytes this peer pulled to replay steps.", "replay_bytes"),
    ("shoal_state_in_sync", "gauge", "1 if it held or adopted the majority's state last round.", "synced"),
    ("shoal_stragglers", "counter", "Expected peers whose payload missed a round, seen here.", "stragglers"),
    ("shoal_late_rounds", "counter", "Rounds its payload missed, late for their deadline.", "late"),
    ("shoal_coordinated_rounds", "counter", "Rounds the coordinator decided.", "coordinated_rounds"),
    ("shoal_relayed_payloads", "counter", "Payloads pulled from a peer other than their author.", "relayed"),
    ("shoal_butterfly_rounds", "counter", "Rounds averaged piece by piece.", "butterfly_rounds"),
    ("shoal_pieces_recomputed", "counter", "Pieces averaged here, owner late.", "pieces_recomputed"),
    ("shoal_fanin_left_out_rounds", "counter", "Rounds --gather left its payload out of.", "left_out"),
    ("shoal_rejoins", "counter", "Times it found itself alone and dialled its initial peers.", "rejoins"),
    ("shoal_isolated", "gauge", "1 while it reaches no other peer and sits the rounds out.", "isolated"),
    ("shoal_isolated_rounds", "counter", "Rounds it reached no peer in, isolated.", "isolated_rounds"),
)  # fmt: skip


class SwarmCollector(Collector):
    """The SwarmExchange's running counters (`SwarmExchange.counters()`), read at scrape time."""

    KINDS = ("payload", "state", "replay", "probe", "dht")

    def __init__(self, counters: Callable[[], dict[str, Any]]):
        self.counters = counters

    def collect(self) -> Iterator[Metric]:
        c = self.counters()
        sent = CounterMetricFamily("shoal_sent_bytes", "Bytes this peer sent, by kind.", labels=["kind"])
        received = CounterMetricFamily(
            "shoal_received_bytes", "Bytes this peer received, by kind.", labels=["kind"]
        )
        for kind in self.KINDS:
            sent.add_metric([kind], c["sent"].get(kind, 0))
            if kind != "probe":
                received.add_metric([kind], c["received"].get(kind, 0))
        yield sent
        yield received
        rejected = CounterMetricFamily(
            "shoal_rejected_payloads",
            "Announcements, payloads, records and requests from other peers dropped, by reason.",
            labels=["reason"],
        )
        counts = dict.fromkeys(REJECTION_REASONS, 0) | c["rejected"]
        for reason, count in sorted(counts.items()):
            rejected.add_metric([reason], count)
        yield rejected
        for name, kind, text, key in SCALARS:
            family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            yield family(name, text, value=float(c[key]))


class CheckpointCollector(Collector):
    """Checkpoint writes that failed (CheckpointStore.write_failures), read at scrape time."""

    def __init__(self, write_failures: Callable[[], int]):
        self.write_failures = write_failures

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily(
            "shoal_checkpoint_write_failures",
            "Checkpoints that could not be written (folder not writable, disk full); training went on.",
            value=float(self.write_failures()),
        )


def build_info(
    *, version: str, torch_version: str, device: str, algorithm: str, model: str, run: str, peer_id: str
) -> dict[str, str]:
    return {
        "version": version,
        "torch": torch_version,
        "python": platform.python_version(),
        "device": device,
        "algorithm": algorithm,
        "model": model,
        "run": run,
        "peer_id": peer_id,
    }
