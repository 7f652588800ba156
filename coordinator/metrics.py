"""The coordinator's Prometheus metrics, on `/metrics` of `--metrics-port`.

Series carry no peer ids (low cardinality): the round, members, the last round's participants and
stragglers, evictions, refused requests by status code, and round durations.
"""

import platform
from importlib.metadata import version
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, start_http_server

from shoal.coordinator.actions import Action, Announced, Capped, Decided, Dropped
from shoal.coordinator.state import SwarmState

ROUND_BUCKETS = (0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800)
# exposed at 0 from the start: the reasons rounds.py drops members for, the codes requests are refused with
DROP_REASONS = ("left", "silent", "evicted")
REQUESTS = ("join", "leave", "heartbeat", "rounds", "report", "roundresult", "swarmstatus")
"""The requests, as rate limits and size refusals name them (their message type, lower case)."""
REFUSAL_CODES = (
    "invalid_argument", "out_of_range", "already_exists", "not_found", "failed_precondition",
    "resource_exhausted", "unauthenticated", "permission_denied",
)  # fmt: skip


class CoordinatorMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        Info("shoal_coordinator_build", "Versions of this coordinator (value 1).", registry=r).info(
            {"version": version("shoal"), "python": platform.python_version()}
        )
        self.round = Gauge("shoal_coordinator_round", "The round last announced.", registry=r)
        self.exchange_window = Gauge(
            "shoal_coordinator_exchange_window_seconds",
            "Exchange window of the round last announced (after its compute deadline).",
            registry=r,
        )
        self.members = Gauge("shoal_coordinator_active_peers", "Current members of the swarm.", registry=r)
        self.participants = Gauge(
            "shoal_coordinator_participants", "Participants of the last decided round.", registry=r
        )
        self.stragglers = Counter(
            "shoal_coordinator_stragglers", "Expected members left out of a round as late.", registry=r
        )
        self.evictions = Counter(
            "shoal_coordinator_evictions", "Members evicted as repeated stragglers.", registry=r
        )
        self.dropped = Counter(
            "shoal_coordinator_dropped_peers", "Members dropped, by reason.", ["reason"], registry=r
        )
        self.capped = Counter(
            "shoal_coordinator_capped_reports",
            "Reports that claimed more samples than their member can have computed (counted at the bound).",
            registry=r,
        )
        self.refused = Counter(
            "shoal_coordinator_refused_requests",
            "Requests refused, by gRPC status code.",
            ["code"],
            registry=r,
        )
        self.rate_limited = Counter(
            "shoal_coordinator_rate_limited_requests",
            "Requests refused for exceeding a limit, by method and by what was limited (peer id or address).",
            ["method", "by"],
            registry=r,
        )
        self.oversized = Counter(
            "shoal_coordinator_oversized_requests",
            "Requests refused for their size, by method.",
            ["method"],
            registry=r,
        )
        self.round_duration = Histogram(
            "shoal_coordinator_round_duration_seconds",
            "From one announcement to the next.",
            buckets=ROUND_BUCKETS,
            registry=r,
        )
        self._announced_at: float | None = None
        self._server: WSGIServer | None = None
        self._zero_series()

    def _zero_series(self) -> None:
        """Every labelled series exists from the start, at 0 (dashboards, alerts)."""
        for reason in DROP_REASONS:
            self.dropped.labels(reason=reason)
        for method in REQUESTS:
            self.oversized.labels(method=method)
            for by in ("peer", "address"):
                self.rate_limited.labels(method=method, by=by)
        for code in REFUSAL_CODES:
            self.refused.labels(code=code)

    def observe(self, action: Action, state: SwarmState) -> None:
        self.members.set(len(state.members))
        match action:
            case Announced(round=announced):
                if self._announced_at is not None:
                    self.round_duration.observe(announced.announced_at - self._announced_at)
                self._announced_at = announced.announced_at
                self.round.set(announced.number)
                self.exchange_window.set(announced.exchange_deadline - announced.compute_deadline)
            case Decided(round=decided):
                self.participants.set(len(decided.participants))
                self.stragglers.inc(len(decided.stragglers))
            case Capped():
                self.capped.inc()
            case Dropped(reason=reason):
                self.dropped.labels(reason=reason).inc()
                if reason == "evicted":
                    self.evictions.inc()

    def serve(self, port: int, host: str = "0.0.0.0") -> int:
        """Serves `/metrics` in a daemon thread; returns the port bound (port 0: any free one)."""
        self._server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return self._server.server_port

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
