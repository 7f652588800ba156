"""Joining a swarm's DHT, with a message a volunteer can act on when it fails.

hivemind reports an unreachable bootstrap peer as `P2PDaemonError: Daemon failed to start: failed to
connect to bootstrap peers`. `start_dht` checks each initial peer's address first, and on failure
probes each one's TCP port so that the error says which address was tried, whether anything answers
there, and what to try next.

The DHT's process, and the p2pd daemon it starts, die with the process that started them, even on
kill -9 (shoal.peer.swarm.lifeline): `TetheredDHT`.
"""

import asyncio
import contextlib
import gc
import ipaddress
import multiprocessing
import os
import signal
import socket
import threading
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, cast

import hivemind
from hivemind.dht.protocol import DHTProtocol
from hivemind.p2p import P2PContext, P2PDaemonError
from hivemind.proto import dht_pb2
from hivemind.utils.multiaddr import Multiaddr
from hivemind.utils.multiaddr.exceptions import Error as MultiaddrError

from shoal.peer.swarm.lifeline import die_with_parent
from shoal.peer.swarm.relay import RelayServer

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

# the DHT nodes that store each record and announcement (hivemind's default is 5): a run's reads and
# writes ask only these (shoal.peer.swarm.directory), and each node asked answers with every peer's
# entry under the key, so a read or write costs REPLICAS * N entries on the wire
REPLICAS = 3
# hivemind's Kademlia caching, off: after a read that found something newer it stores the whole value
# (every peer's entry) on one more node near the key, and a write to a key held in the local cache
# starts a background re-read of it, crawling a beam of 20 nodes; a run's reads ask only the replicas
CACHING = {"cache_nearest": 0, "cache_locally": False}
# the nodes nearest a key that a find answer holding the key's value lists (hivemind lists its
# bucket size, 20): enough for a crawl of the REPLICAS nearest, which is all a run's reads and writes
# are; an answer without the value still lists 20, so a crawl toward a new key converges as before.
# At N peers an answer listed min(N - 1, 20) nodes of 60 B each, the part of a read that grew with N
FOUND_NEIGHBOURS = REPLICAS + 1


class BootstrapError(RuntimeError):
    """The swarm could not be joined; the message says why and what to try."""


class TetheredDHT(hivemind.DHT):
    """hivemind's DHT whose process (and its p2pd) ends when the process that started it dies."""

    def run(self) -> None:
        # objects inherited through fork are never collected here: the parent's garbage may hold gRPC
        # objects (a coordinator link, a test's channels) whose finalizers crash a forked child (a
        # segfault while "Garbage-collecting" in a DHT child, seen in the integration suite)
        gc.freeze()
        parent = multiprocessing.parent_process()
        assert parent is not None and parent.pid is not None  # run() runs in the DHT's own process
        die_with_parent(parent.pid)
        _trim_found_answers()
        super().run()

    def shutdown(self) -> None:
        """hivemind's shutdown, which never hangs and leaves nothing behind: a DHT process that died (a
        kill -9, the OOM killer) is reaped; one that does not end within `shutdown_timeout` is killed,
        and with it the process group it leads (its p2pd, orphaned if the process died first)."""
        if self.pid is None or self._parent_pid != os.getpid():
            return
        if self.is_alive():
            with contextlib.suppress(OSError):  # a pipe closed by a process that just died
                self._outer_pipe.send(("_shutdown", [], {}))
            self.join(self.shutdown_timeout)
        if self.exitcode != 0:
            # the group outlives its leader while p2pd is in it, so its id is no other process's
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)
            self.join(1.0)

    def kill_group(self) -> None:
        """Ends the DHT's process and its p2pd at once (a stop past its time: shoal.peer.train.stopping)."""
        if self.pid is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)

    async def _shutdown(self) -> None:
        # in the DHT's process. hivemind's node removes its handlers before it ends its own daemon, and
        # each removal makes the daemon push its new protocol list to every connected peer (libp2p's
        # identify push): 4 pushes of about 0.6 kB per connection, on connections about to close
        node = self._node
        if not node._should_shutdown_p2p:  # a daemon that lives on is told of the removed handlers
            await node.shutdown()
            return
        node.is_alive = False
        await node.p2p.shutdown()


def found_answers_trimmed(answer):
    """hivemind's find handler `answer`, but an answer that holds a key's value lists only the
    FOUND_NEIGHBOURS nodes nearest the key (hivemind registers a protocol's rpc_ methods by name and
    type hints, hence a wrapper with the same signature)."""

    async def rpc_find(self, request: dht_pb2.FindRequest, context: P2PContext) -> dht_pb2.FindResponse:
        response = await answer(self, request, context)
        for item in response.results:
            if item.type != dht_pb2.NOT_FOUND:
                del item.nearest_node_ids[FOUND_NEIGHBOURS:]
                del item.nearest_peer_ids[FOUND_NEIGHBOURS:]
        return response

    rpc_find.trimmed = True
    return rpc_find


def _trim_found_answers() -> None:
    """In the DHT's process, before its node starts (`found_answers_trimmed`)."""
    if not getattr(DHTProtocol.rpc_find, "trimmed", False):
        DHTProtocol.rpc_find = found_answers_trimmed(DHTProtocol.rpc_find)


def start_shared_memory_manager() -> None:
    """Starts torch's shared-memory manager (torch_shm_manager) of this process, if it has none yet,
    deaf to SIGTERM and SIGINT. hivemind hands every DHT call's result back through torch's shared
    memory in its "file_system" strategy, served by that helper process; one killed by a signal sent
    to every process of the peer (systemd's control group, pkill) made each later call fail, and
    C++ threads abort the peer ("terminate called after throwing an instance of 'std::system_error'
    what(): Broken pipe", exit 134). It inherits the ignored signals and ends by itself once its
    clients (this process and the DHT's) are gone. A no-op where torch already started it."""
    import torch

    if threading.current_thread() is not threading.main_thread():
        torch.empty(1, dtype=torch.uint8).share_memory_()  # signals can be set on the main thread only
        return
    previous = {signum: signal.signal(signum, signal.SIG_IGN) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        torch.empty(1, dtype=torch.uint8).share_memory_()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


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
    dht_kwargs = {"num_replicas": REPLICAS, **CACHING, **dht_kwargs}
    start_shared_memory_manager()
    gc.collect()  # no garbage for the forked child to inherit (TetheredDHT.run)
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


def check_multiaddrs(flag: str, addresses: Sequence[str], *, dialable: bool) -> None:
    """ValueError naming `flag` for the first of `addresses` hivemind cannot use. `dialable`: peers to
    dial (--initial-peers), which need the peer id libp2p dials by (/p2p/...); else addresses of this
    peer's own (--announce-maddrs): TCP, without a peer id."""
    example = (
        "/ip4/203.0.113.5/tcp/31337/p2p/12D3KooW... (the join command a peer printed has one)"
        if dialable
        else "/ip4/203.0.113.5/tcp/31337"
    )
    for address in addresses:
        try:
            protocols = [protocol.name for protocol in Multiaddr(address).protocols()]
        except (MultiaddrError, ValueError, TypeError):
            protocols = None
        if protocols is None or not address.startswith("/"):
            raise ValueError(f"{flag} {address!r} is not a multiaddress like {example}")
        if dialable and "p2p" not in protocols:
            raise ValueError(f"{flag} {address!r} has no peer id (/p2p/...): expected one like {example}")
        if not dialable and ("tcp" not in protocols or "p2p" in protocols):
            raise ValueError(
                f"{flag} {address!r}: expected a TCP multiaddress without a peer id, like {example}"
            )


def best_address(addresses: Sequence[str]) -> str:
    """A public address if there is one, then a private one, then loopback."""
    return sorted(addresses, key=_rank)[0]


def private_only(addresses: Sequence[str]) -> bool:
    """Whether none of `addresses` is public (only private or loopback ones)."""
    return bool(addresses) and min(map(_rank, addresses)) > 0


PRIVATE = tuple(
    ipaddress.ip_network(net)
    for net in (
        "10.0.0.0/8",
        "172.16.0.0/12",
        "192.168.0.0/16",
        "100.64.0.0/10",
        "169.254.0.0/16",
        "fc00::/7",
        "fe80::/10",
    )
)
"""Home, carrier-grade NAT and link-local networks: addresses nobody outside them can dial."""


def _rank(address: str) -> int:
    """0: public (any other address: 198.18.0.0/15 too, for the namespace tests), 1: private, 2: loopback."""
    for protocol in ("ip4", "ip6"):
        try:
            host = ipaddress.ip_address(Multiaddr(address).value_for_protocol(protocol))
        except (MultiaddrError, ValueError, TypeError, KeyError, IndexError):
            continue
        if host.is_loopback:
            return 2
        return 1 if any(host in net for net in PRIVATE if net.version == host.version) else 0
    return 0


class BootstrapNode:
    """A DHT node that trains nothing (`shoal bootstrap`), for peers to join through. It relays for the
    peers behind NAT (shoal.peer.swarm.relay's RelayServer, on an event loop thread of its own over a
    replica of the DHT's libp2p daemon) and offers libp2p's circuit relay (hivemind's `use_relay`).
    Closing it stops the relay and shuts its DHT process and p2pd down."""

    def __init__(self, dht: hivemind.DHT, relay: RelayServer | None = None):
        self.dht, self.relay = dht, relay
        self._metrics_server: WSGIServer | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="shoal-relay", daemon=True)
        self._thread.start()
        self._p2p = None
        if relay is not None:
            try:
                self._p2p = self._call(self._start_relay())
            except BaseException:
                self.close()
                raise

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
        relay_cache_bytes: int | None = 256 << 20,
        max_payload_bytes: int = 1 << 30,
    ) -> "BootstrapNode":
        """The node listening on host:port; `public`: libp2p is told it is reachable from everywhere
        (its AutoNAT would not conclude so for an address outside the global ranges);
        `relay_cache_bytes`: payloads it keeps for the peers it relays to (None: it relays nothing).
        Raises BootstrapError."""
        options: dict = {"use_relay": True}
        if identity_path:
            options["identity_path"] = identity_path
        if announce_maddrs:
            options["announce_maddrs"] = list(announce_maddrs)
        if public:
            options["force_reachability"] = "public"
        dht = start_dht(initial_peers, host_maddrs=[f"/ip4/{host}/tcp/{port}"], **options)
        if relay_cache_bytes is None:
            return cls(dht)
        return cls(dht, RelayServer(max_payload_bytes=max_payload_bytes, cache_bytes=relay_cache_bytes))

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
        if self.relay is not None:
            registry.register(RelayCollector(self))
        self._metrics_server, _ = start_http_server(port, addr=host, registry=registry)
        return self._metrics_server.server_port

    def relay_counters(self) -> dict[str, dict[str, float]]:
        """A copy of the relay's counters, taken on its loop (for another thread)."""

        async def copy() -> dict[str, dict[str, float]]:
            relay = cast(RelayServer, self.relay)  # read only for a node that relays (`RelayCollector`)
            return {
                "sent": dict(relay.sent),
                "fetched": dict(relay.fetched),
                "streams": dict(relay.streams),
                "rejected": dict(relay.rejected),
                "cache": {"bytes": relay.cached_bytes, "payloads": len(relay.cache)},
            }

        return self._call(copy())

    def close(self) -> None:
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
        if self._p2p is not None:
            with contextlib.suppress(Exception):
                self._call(self._stop_relay(), timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self.dht.shutdown()

    def _call(self, coroutine, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    async def _start_relay(self):
        p2p = await self.dht.replicate_p2p()
        await self.relay.start(p2p)
        return p2p

    async def _stop_relay(self) -> None:
        assert self.relay is not None and self._p2p is not None  # started: a node that relays
        await self.relay.stop()
        await self._p2p.shutdown()

    def __enter__(self) -> "BootstrapNode":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RelayCollector:
    """The relay's counters as Prometheus metrics, read when scraped."""

    def __init__(self, node: BootstrapNode):
        self.node = node

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        counts = self.node.relay_counters()
        families = (
            ("shoal_relay_sent_bytes", "Bytes the relay sent to asking peers, by kind", "kind", "sent"),
            ("shoal_relay_fetched_bytes", "Bytes fetched from peers behind it, by kind", "kind", "fetched"),
            ("shoal_relay_streams", "Requests answered, by kind (cached: from its cache)", "kind", "streams"),
            ("shoal_relay_rejected", "Relay requests refused or failed, by reason", "reason", "rejected"),
        )  # fmt: skip
        for name, text, label, key in families:
            family = CounterMetricFamily(name, text, labels=[label])
            for value, amount in sorted(counts[key].items()):
                family.add_metric([value], amount)
            yield family
        yield GaugeMetricFamily(
            "shoal_relay_cache_bytes", "Bytes of payloads the relay keeps", value=counts["cache"]["bytes"]
        )


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
