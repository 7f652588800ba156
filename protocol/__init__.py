"""shoal.protocol: the wire contract.

The `.proto` files here, the code generated from them (`python -m shoal.protocol.generate`), and the
checks that every message from another peer or client passes before anything else reads it. This
package imports neither torch nor anything else of shoal, so the coordinator can use it on a small box.
"""

from shoal.protocol.errors import MalformedPayloadError
from shoal.protocol.parse import parse_message
from shoal.protocol.payload_pb2 import Payload
from shoal.protocol.rules import TALLY_HOLDERS
from shoal.protocol.tensor_pb2 import CodecId, DType, EncodedTensor, IndexCoding, ValueEncoding

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
