"""shoal.protocol: the wire contract.

The `.proto` files here, the code generated from them (`python -m shoal.protocol.generate`), and the
checks that every message from another peer or client passes before anything else reads it. This
package imports neither torch nor anything else of shoal, so the coordinator can use it on a small box.
"""

from shoal.protocol.errors import MalformedPayloadError
from shoal.protocol.parse import parse_message
from shoal.protocol.payload_pb2 import Payload
from shoal.protocol.tensor_pb2 import CodecId, DType, EncodedTensor, IndexCoding, ValueEncoding

TALLY_HOLDERS = 4
"""Holders a coordinator names per state in a round's tally (`RoundResultReply.votes`, with
`--gather`), and the most a peer takes from one: more is another peer's text to dial."""

__all__ = [
    "TALLY_HOLDERS",
    "CodecId",
    "DType",
    "EncodedTensor",
    "IndexCoding",
    "MalformedPayloadError",
    "Payload",
    "ValueEncoding",
    "parse_message",
]
