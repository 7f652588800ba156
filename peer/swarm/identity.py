"""A peer's persistent identity: one file, hivemind's own format.

The file is a libp2p `PrivateKey` protobuf holding an RSA key in DER, exactly what hivemind's
`P2P.generate_identity` writes: passed as the DHT's `identity_path` it fixes the libp2p peer id,
and the Ed25519 key derived from it signs the peer's DHT records (its public key is the record
subkey, see shoal.peer.swarm.signing), so a restarted peer is recognized as itself everywhere.
"""

import os
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey

MAX_IDENTITY_BYTES = 16 << 10


class IdentityError(ValueError):
    """The identity file is missing, unreadable or not an RSA key."""


def keygen(path: str | Path) -> RSAPrivateKey:
    """Writes a new identity to `path` (owner-readable only); refuses to overwrite one."""
    path = Path(path)
    key = RSAPrivateKey()
    message = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=key.to_bytes())
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise IdentityError(f"{path} already exists; remove it first to replace that identity") from None
    except OSError as error:
        raise IdentityError(f"cannot create {path}: {error.strerror}") from None
    with os.fdopen(descriptor, "wb") as out:
        out.write(message.SerializeToString())
        out.flush()
        os.fsync(out.fileno())
    return key


def load_identity(path: str | Path) -> RSAPrivateKey:
    """The RSA key of an identity file written by `keygen` (or by hivemind)."""
    path = Path(path)
    try:
        data = path.read_bytes()[: MAX_IDENTITY_BYTES + 1]
    except OSError as error:
        raise IdentityError(
            f"cannot read identity {path}: {error.strerror} (create one: shoal keygen PATH)"
        ) from None
    if len(data) > MAX_IDENTITY_BYTES:
        raise IdentityError(f"{path} is larger than an identity file")
    message = crypto_pb2.PrivateKey()
    try:
        message.ParseFromString(data)
        if message.key_type != crypto_pb2.KeyType.RSA:
            raise ValueError("not an RSA key")
        private = serialization.load_der_private_key(message.data, password=None)
    except Exception as error:  # protobuf DecodeError, cryptography's ValueError/UnsupportedAlgorithm
        raise IdentityError(f"{path} is not a shoal/hivemind identity file: {error}") from None
    if not isinstance(private, rsa.RSAPrivateKey):
        raise IdentityError(f"{path} does not hold an RSA key")
    key = RSAPrivateKey.__new__(RSAPrivateKey)
    key.__setstate__({"_private_key": message.data})
    return key


def peer_id_of(path: str | Path) -> str:
    """The libp2p peer id an identity file gives (base58)."""
    from hivemind.p2p import PeerID

    return PeerID.from_identity(Path(path).read_bytes()).to_base58()
