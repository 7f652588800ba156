"""The token ledger on the wire: a lane's claim appended to its payload (`claim_bytes`, read back by
`claim_of` without decoding the tensors), and the ledger's bytes as a float32 tensor of the shared
state (`view_tensor`, `view_bytes`). shoal.peer.data.ledger uses them."""

from typing import TYPE_CHECKING

import numpy as np
import torch
from google.protobuf.message import DecodeError

from shoal.protocol.payload_pb2 import Payload, Trained

if TYPE_CHECKING:
    from shoal.peer.data.ledger import Claim

# -- the ledger in the shared state (float32 tensors: shoal.peer.swarm.state) ---------------------


def view_tensor(data: bytes) -> torch.Tensor:
    """A ledger's bytes as a float32 tensor of their 16-bit words, each exact in float32."""
    words = np.frombuffer(data + b"\0" * (len(data) % 2), dtype="<u2")
    return torch.from_numpy(words.astype(np.float32))


def view_bytes(tensor: torch.Tensor, size: int) -> bytes:
    """`view_tensor`'s bytes back; ValueError unless it holds `size` bytes' words."""
    values = tensor.detach().reshape(-1).to("cpu", torch.float64).numpy()
    if len(values) != (size + 1) // 2 or not np.all(
        (values >= 0) & (values < 1 << 16) & (values == np.floor(values))
    ):
        raise ValueError(f"not a ledger of {size} bytes")
    return values.astype("<u2").tobytes()[:size]


# -- claims on the wire (protocol/payload.proto: Payload.trained) ----------------------------------


def claim_bytes(claim: "Claim") -> bytes:
    """The claim as a serialized Payload holding only it: appended to a payload's bytes, protobuf
    reads the two as one message."""
    trained = Trained(
        round=claim.round, slot=claim.slot, slots=claim.slots, places=claim.windows, ledger=claim.ledger
    )
    return Payload(trained=trained).SerializeToString()


def claim_of(payload: bytes) -> "Claim | None":
    """The claim a payload carries (its last `trained` field), read without decoding its tensors;
    None if it carries none or its framing is broken."""
    view, i, found = memoryview(payload), 0, None
    try:
        while i < len(view):
            key, i = _varint(view, i)
            field, wire = key >> 3, key & 7
            if wire == 2:
                length, i = _varint(view, i)
                if i + length > len(view):
                    return None
                if field == 2:
                    found = view[i : i + length]
                i += length
            elif wire == 0:
                _, i = _varint(view, i)
            elif wire in (1, 5):
                i += 8 if wire == 1 else 4
            else:
                return None
        if found is None:
            return None
        trained = Trained.FromString(bytes(found))
    except (ValueError, DecodeError):
        return None
    from shoal.peer.data.ledger import Claim

    return Claim(trained.round, trained.slot, trained.slots, trained.places, trained.ledger)


def _varint(view: memoryview, i: int) -> tuple[int, int]:
    value = shift = 0
    while shift < 64:
        if i >= len(view):
            raise ValueError("a truncated varint")
        byte = view[i]
        i += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, i
        shift += 7
    raise ValueError("a varint longer than 10 bytes")
