"""Find answers that hold a value list only the nodes nearest the key: hivemind's own protocol and
routing table, the handler called directly."""

import asyncio

from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID, RoutingTable
from hivemind.dht.storage import DHTLocalStorage
from hivemind.p2p import PeerID
from hivemind.proto import dht_pb2
from hivemind.utils import get_dht_time

from shoal.peer.swarm.bootstrap import FOUND_NEIGHBOURS, found_answers_trimmed


def protocol_knowing(peers: int) -> DHTProtocol:
    protocol = DHTProtocol(_initialized_with_create=True)
    protocol.bucket_size = 20
    protocol.storage, protocol.cache = DHTLocalStorage(), DHTLocalStorage()
    protocol.routing_table = RoutingTable(DHTID.generate(), bucket_size=20, depth_modulo=5)
    protocol.node_info = dht_pb2.NodeInfo(node_id=protocol.routing_table.node_id.to_bytes())

    async def no_ping(*_):  # the asker is not added to the routing table here
        return None

    protocol.rpc_ping = no_ping
    for _ in range(peers):
        node = DHTID.generate()
        protocol.routing_table.add_or_update_node(node, PeerID(b"peer" + node.to_bytes()))
    return protocol


def answers(protocol: DHTProtocol, handler, *keys: DHTID) -> list:
    request = dht_pb2.FindRequest(keys=[key.to_bytes() for key in keys], peer=dht_pb2.NodeInfo())
    return list(asyncio.run(handler(protocol, request, None)).results)


def test_an_answer_with_the_value_lists_only_the_nearest_nodes_one_without_lists_all():
    protocol = protocol_knowing(peers=15)
    held, missing = DHTID.generate(), DHTID.generate()
    protocol.storage.store(held, b"value", get_dht_time() + 60)
    stock = answers(protocol, DHTProtocol.rpc_find, held, missing)
    trimmed = answers(protocol, found_answers_trimmed(DHTProtocol.rpc_find), held, missing)
    assert [len(item.nearest_peer_ids) for item in stock] == [15, 15]
    assert trimmed[0].type == dht_pb2.FOUND_REGULAR and trimmed[0].value == b"value"
    assert len(trimmed[0].nearest_node_ids) == len(trimmed[0].nearest_peer_ids) == FOUND_NEIGHBOURS
    # the nearest of the stock answer's, in its order: a crawl toward the key goes on as before
    assert list(trimmed[0].nearest_node_ids) == list(stock[0].nearest_node_ids)[:FOUND_NEIGHBOURS]
    assert trimmed[1] == stock[1]
