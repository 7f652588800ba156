"""Joining a swarm's DHT, with a message a volunteer can act on when it fails.

hivemind reports an unreachable bootstrap peer as `P2PDaemonError: Daemon failed to start: failed to
connect to bootstrap peers`. `start_dht` checks each initial peer's address first, and on failure
probes each one's TCP port so that the error says which address was tried, whether anything answers
there, and what to try next.

The DHT's process, and the p2pd daemon it starts, die with the process that started them, even on
kill -9 (shoal.peer.swarm.lifeline): `TetheredDHT`.
"""

import multiprocessing
import socket
from collections.abc import Sequence
from datetime import timedelta

import hivemind
from hivemind.p2p import P2PDaemonError
from hivemind.utils.multiaddr import Multiaddr
from hivemind.utils.multiaddr.exceptions import Error as MultiaddrError

from shoal.peer.swarm.lifeline import die_with_parent


class BootstrapError(RuntimeError):
    """The swarm could not be joined; the message says why and what to try."""


class TetheredDHT(hivemind.DHT):
    """hivemind's DHT whose process (and its p2pd) ends when the process that started it dies."""

    def run(self) -> None:
        die_with_parent(multiprocessing.parent_process().pid)
        super().run()


def start_dht(
    initial_peers: Sequence[str],
    *,
    host_maddrs: Sequence[str] = ("/ip4/0.0.0.0/tcp/0",),
    probe_timeout: timedelta = timedelta(seconds=3),
    **dht_kwargs,
) -> hivemind.DHT:
    """A running DHT joined through `initial_peers` (none: a new swarm). Create it before starting
    threads: hivemind forks a process for it."""
    addresses = [_parse(peer) for peer in initial_peers]
    try:
        return TetheredDHT(
            start=True, initial_peers=list(initial_peers), host_maddrs=list(host_maddrs), **dht_kwargs
        )
    except P2PDaemonError as error:
        if not addresses:
            raise BootstrapError(f"could not start the DHT on {list(host_maddrs)}: {error}") from None
        reports = "\n".join(
            f"  {peer}: {_probe(address, probe_timeout)}"
            for peer, address in zip(initial_peers, addresses, strict=True)
        )
        raise BootstrapError(
            "could not join the swarm through any initial peer:\n"
            f"{reports}\n"
            "Check that the address is current (a restarted peer prints a new one) and that its port is open "
            "to you. If the bootstrap peer is behind NAT, it can be reached through a libp2p relay "
            "(hivemind's use_relay / use_auto_relay)."
        ) from None


def check_multiaddr(address: str) -> str | None:
    """Why `address` is not a multiaddress hivemind can use (None: it is)."""
    try:
        Multiaddr(address)
    except (MultiaddrError, ValueError, TypeError) as error:
        return str(error) or type(error).__name__
    return None


def best_address(addresses: Sequence[str]) -> str:
    """A public address if there is one, then a private one, then loopback."""

    def rank(address: str) -> int:
        if "/ip4/127." in address or "/ip6/::1/" in address:
            return 2
        private = ("/ip4/10.", "/ip4/192.168.", "/ip4/172.", "/ip4/100.")
        return 1 if address.startswith(private) else 0

    return sorted(addresses, key=rank)[0]


class BootstrapNode:
    """A DHT node that trains nothing (`shoal bootstrap`), for peers to join through; it offers libp2p's
    circuit relay (hivemind's `use_relay`). Closing it shuts its DHT process and p2pd down."""

    def __init__(self, dht: hivemind.DHT):
        self.dht = dht
        self._metrics_server = None

    @classmethod
    def start(
        cls,
        *,
        host: str,
        port: int,
        identity_path: str | None = None,
        announce_maddrs: Sequence[str] = (),
        initial_peers: Sequence[str] = (),
        public: bool = False,
    ) -> "BootstrapNode":
        """The node listening on host:port; `public`: libp2p is told it is reachable from everywhere
        (its AutoNAT would not conclude so for an address outside the global ranges). Raises
        BootstrapError."""
        options: dict = {"use_relay": True}
        if identity_path:
            options["identity_path"] = identity_path
        if announce_maddrs:
            options["announce_maddrs"] = list(announce_maddrs)
        if public:
            options["force_reachability"] = "public"
        return cls(start_dht(initial_peers, host_maddrs=[f"/ip4/{host}/tcp/{port}"], **options))

    @property
    def address(self) -> str:
        """The address peers join through (`best_address` of the visible ones)."""
        return best_address([str(a) for a in self.dht.get_visible_maddrs()])

    def connections(self) -> int:
        """Peers this node's libp2p daemon is connected to now."""
        return self.dht.run_coroutine(_connected_peers)

    def serve_metrics(self, host: str, port: int) -> int:
        """Prometheus metrics on host:port/metrics (port 0: any free one); returns the port."""
        from prometheus_client import CollectorRegistry, Gauge, start_http_server

        registry = CollectorRegistry()
        connected = Gauge(
            "shoal_bootstrap_connections", "Peers connected to this bootstrap node", registry=registry
        )
        connected.set_function(self.connections)
        self._metrics_server, _ = start_http_server(port, addr=host, registry=registry)
        return self._metrics_server.server_port

    def close(self) -> None:
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
        self.dht.shutdown()

    def __enter__(self) -> "BootstrapNode":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def _connected_peers(_dht: hivemind.DHT, node) -> int:
    """In the DHT's process: the peers its p2pd is connected to."""
    return len(await node.p2p.list_peers())


def _parse(peer: str) -> Multiaddr:
    try:
        address = Multiaddr(peer)
        address.value_for_protocol("p2p")
    except MultiaddrError:
        raise BootstrapError(
            f"initial peer {peer!r} is not a peer multiaddress like /ip4/203.0.113.7/tcp/31337/p2p/12D3Koo..."
        ) from None
    return address


def _probe(address: Multiaddr, timeout: timedelta) -> str:
    """Whether the address's TCP port answers, in words."""
    host = next(
        (address.value_for_protocol(p) for p in ("ip4", "ip6", "dns", "dns4", "dns6") if _has(address, p)),
        None,
    )
    port = address.value_for_protocol("tcp") if _has(address, "tcp") else None
    if host is None or port is None:
        return "no TCP address to probe (only TCP addresses are checked)"
    try:
        with socket.create_connection((host, int(port)), timeout=timeout.total_seconds()):
            return f"TCP {host}:{port} accepts connections, but the libp2p handshake failed (wrong peer id?)"
    except ConnectionRefusedError:
        return f"TCP {host}:{port} refused the connection: nothing listens there"
    except TimeoutError:
        return f"TCP {host}:{port} did not answer within {timeout.total_seconds():.0f} s (firewall or NAT?)"
    except OSError as error:
        return f"TCP {host}:{port} unreachable: {error.strerror or error}"


def _has(address: Multiaddr, protocol: str) -> bool:
    return any(p.name == protocol for p in address.protocols())
