"""Ed25519-signed DHT records (shoal.peer.swarm.signing): only the owner writes, bad input is refused."""

import pickle

import pytest
from hivemind.dht.validation import DHTRecord
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.serializer import MSGPackSerializer
from pydantic.v1 import BaseModel, ValidationError

from shoal.peer.swarm.signing import (
    SIGNATURE_OVERHEAD,
    Ed25519RecordValidator,
    OwnerSubkey,
    owner_marker,
    record_key,
)

IDENTITY = RSAPrivateKey()


def _record(
    validator: Ed25519RecordValidator, value: bytes = b"value", subkey: bytes | None = None
) -> DHTRecord:
    subkey = MSGPackSerializer.dumps(validator.local_public_key if subkey is None else subkey)
    return DHTRecord(b"k" * 32, subkey, value, 1e9)


def _signed(validator: Ed25519RecordValidator, record: DHTRecord) -> DHTRecord:
    return DHTRecord(record.key, record.subkey, validator.sign_value(record), record.expiration_time)


def test_the_key_comes_from_the_identity_and_is_smaller_than_rsa():
    assert owner_marker(record_key(IDENTITY)) == owner_marker(record_key(IDENTITY))
    assert owner_marker(record_key(IDENTITY)) != owner_marker(record_key(RSAPrivateKey()))
    validator = Ed25519RecordValidator(record_key(IDENTITY))
    assert len(validator.local_public_key) == 42  # hivemind's RSA marker: 388
    record = _record(validator)
    assert len(validator.sign_value(record)) - len(record.value) == SIGNATURE_OVERHEAD == 70  # RSA: 356


def test_the_owner_signs_and_every_node_checks():
    validator = Ed25519RecordValidator(record_key(IDENTITY))
    signed = _signed(validator, _record(validator))
    other = Ed25519RecordValidator(record_key(RSAPrivateKey()))
    assert validator.validate(signed) and other.validate(signed)
    assert other.strip_value(signed) == b"value"
    restored = pickle.loads(pickle.dumps(validator))  # validators travel to the DHT's process
    assert restored.local_public_key == validator.local_public_key and restored.validate(signed)


def test_forged_tampered_and_unsigned_records_are_refused():
    alice = Ed25519RecordValidator(record_key(IDENTITY))
    mallory = Ed25519RecordValidator(record_key(RSAPrivateKey()))
    honest = _record(alice)
    # mallory signs a record under alice's subkey: her key is not the one named
    forged = DHTRecord(
        honest.key, honest.subkey, honest.value + mallory.sign_value(_record(mallory))[-70:], 1e9
    )
    assert not alice.validate(forged)
    signed = _signed(alice, honest)
    assert not alice.validate(DHTRecord(signed.key, signed.subkey, b"other" + signed.value[5:], 1e9))
    assert not alice.validate(DHTRecord(signed.key, signed.subkey, signed.value, 2e9))  # expiry changed
    assert not alice.validate(honest)  # marked, unsigned
    assert not alice.validate(DHTRecord(honest.key, honest.subkey, signed.value[:-1], 1e9))  # cut short
    two = MSGPackSerializer.dumps(alice.local_public_key + mallory.local_public_key)
    assert not alice.validate(_signed(alice, _record(alice, subkey=two)))
    unmarked = _record(alice, subkey=b"anyone")
    assert alice.validate(unmarked) and alice.sign_value(unmarked) == unmarked.value  # unprotected


class _Model(BaseModel):
    peers: dict[OwnerSubkey, int]


@pytest.mark.parametrize(
    "subkey",
    [
        b"[owner:rsa]",
        b"[ed25519:" + bytes(31) + b"]",
        b"x[ed25519:" + bytes(32) + b"]",
        b"[ed25519:" + bytes(33) + b"]",
    ],
)
def test_a_run_subkey_is_exactly_one_owner_marker(subkey):
    assert _Model(peers={b"[ed25519:" + b"\n" * 32 + b"]": 1})
    with pytest.raises(ValidationError):
        _Model(peers={subkey: 1})
