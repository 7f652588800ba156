"""Signed DHT records with Ed25519: who wrote a record, unforgeably, in 102 bytes instead of 744.

A peer's records sit under a subkey naming its public key, `[ed25519:<32 bytes>]`, and their values
end with `[sig:<64 bytes>]`, its signature over the record (key, subkey, value, expiry). Every DHT node
checks it on store, so no one else can write or overwrite them. hivemind's own `RSASignatureValidator`
works the same way with an RSA-2048 key (a 388-byte subkey and a 356-byte signature); every read
returns every peer's entry from each node it asks, so at 16 peers that difference was most of a round's
DHT bytes (BENCHMARKS.md).

The signing key is derived from the peer's identity file (an RSA key, which fixes its libp2p peer
id): a restarted peer keeps its subkey, and the identity file format does not change.
"""

import hashlib
import re

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from hivemind.dht.schema import conbytes
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.serializer import MSGPackSerializer

KEY_BYTES, SIGNATURE_BYTES = 32, 64
OWNER = re.compile(rb"\[ed25519:(.{%d})\]" % KEY_BYTES, re.DOTALL)
SIGNED = re.compile(rb"(.*)\[sig:(.{%d})\]" % SIGNATURE_BYTES, re.DOTALL)
OWNER_SUBKEY_REGEX = rb"(?s)\[ed25519:.{%d}\]\Z" % KEY_BYTES
SIGNATURE_OVERHEAD = len(b"[sig:]") + SIGNATURE_BYTES

OwnerSubkey = conbytes(regex=OWNER_SUBKEY_REGEX)
"""A schema field type: exactly one owner marker (a run's per-peer subkeys)."""

_DERIVATION = b"shoal DHT record key v1\x00"


def record_key(identity: RSAPrivateKey) -> Ed25519PrivateKey:
    """The Ed25519 key a peer signs its records with: derived from (and as secret as) its identity."""
    return Ed25519PrivateKey.from_private_bytes(hashlib.sha256(_DERIVATION + identity.to_bytes()).digest())


def owner_marker(key: Ed25519PrivateKey) -> bytes:
    """`[ed25519:<public key>]`: the subkey of records only `key` can write."""
    return b"[ed25519:" + key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw) + b"]"


class Ed25519RecordValidator(RecordValidatorBase):
    """A hivemind record validator (pass it in `record_validators`): a record whose key or subkey holds
    an owner marker must carry that owner's signature; unmarked records pass (hivemind's convention)."""

    def __init__(self, key: Ed25519PrivateKey):
        self._key = key
        self.local_public_key = owner_marker(key)

    def validate(self, record: DHTRecord) -> bool:
        owners = OWNER.findall(record.key) + (OWNER.findall(record.subkey) if record.subkey else [])
        if not owners:
            return True
        signed = SIGNED.fullmatch(record.value)
        if len(owners) != 1 or signed is None:
            return False
        body, signature = signed.groups()
        try:
            Ed25519PublicKey.from_public_bytes(owners[0]).verify(signature, _signed_bytes(record, body))
        except InvalidSignature:
            return False
        return True

    def sign_value(self, record: DHTRecord) -> bytes:
        if self.local_public_key not in record.key and self.local_public_key not in (record.subkey or b""):
            return record.value
        return record.value + b"[sig:" + self._key.sign(_signed_bytes(record, record.value)) + b"]"

    def strip_value(self, record: DHTRecord) -> bytes:
        signed = SIGNED.fullmatch(record.value)
        return record.value if signed is None else signed.group(1)

    @property
    def priority(self) -> int:
        return 10  # validated before the validators that deserialize the value (the schema's)

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return isinstance(other, Ed25519RecordValidator)  # one key signs; a second validator adds nothing

    def __getstate__(self) -> dict:
        return {"key": self._key.private_bytes_raw()}

    def __setstate__(self, state: dict) -> None:
        type(self).__init__(self, Ed25519PrivateKey.from_private_bytes(state["key"]))


def _signed_bytes(record: DHTRecord, value: bytes) -> bytes:
    return MSGPackSerializer.dumps((record.key, record.subkey, value, record.expiration_time))
