"""Joining a swarm: actionable errors for bad or unreachable initial peers, and a plain hivemind-dht node."""

import socket

import pytest

from shoal.peer.swarm.bootstrap import BootstrapError, start_dht

PEER_ID = "12D3KooWAWh5yFSnH2mTeaEXarpiTHz6NtC5BLTA3wBDS8pD1tn7"


def closed_port() -> int:
    with socket.socket() as probe:  # a port the OS just handed out and nobody listens on now
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.timeout(60)
def test_unreachable_initial_peer_is_named_with_what_was_found_there():
    address = f"/ip4/127.0.0.1/tcp/{closed_port()}/p2p/{PEER_ID}"
    with pytest.raises(BootstrapError) as error:
        start_dht([address], host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    message = str(error.value)
    assert address in message and "refused the connection" in message and "relay" in message


@pytest.mark.timeout(60)
def test_listening_port_with_wrong_peer_id_is_told_apart():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        address = f"/ip4/127.0.0.1/tcp/{listener.getsockname()[1]}/p2p/{PEER_ID}"
        with pytest.raises(BootstrapError, match="accepts connections, but the libp2p handshake failed"):
            start_dht([address], host_maddrs=["/ip4/127.0.0.1/tcp/0"])


@pytest.mark.parametrize(
    "address", ["203.0.113.7:31337", "/ip4/127.0.0.1/tcp/4001", "/ip4/1.2.3/tcp/1/p2p/x"]
)
def test_malformed_initial_peer_is_refused_before_starting_anything(address):
    with pytest.raises(BootstrapError, match="is not a peer multiaddress"):
        start_dht([address])


@pytest.mark.timeout(60)
def test_a_second_dht_joins_the_first():
    first = start_dht([], host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        second = start_dht([str(a) for a in first.get_visible_maddrs()], host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        try:
            assert second.peer_id != first.peer_id
        finally:
            second.shutdown()
    finally:
        first.shutdown()
