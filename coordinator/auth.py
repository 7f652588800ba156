"""Token authentication of the coordinator's callers.

A token file holds one entry per line; blank lines and `#` comments are ignored:

    <token>              a swarm token: any peer that presents it may call, under any peer id
    <peer id> <token>    a per-peer token: valid only for calls about that peer id

Callers send `authorization: Bearer <token>` metadata. Tokens are compared in constant time. Without a
token file the coordinator accepts every caller (fine on a private network, not on the internet).
"""

import hmac
from pathlib import Path
from typing import TypeAlias

from shoal.coordinator.actions import Refused
from shoal.protocol.rules import is_peer_id

Metadata: TypeAlias = tuple[tuple[str, str | bytes], ...]
"""A call's metadata: (key, value) pairs, binary values as bytes."""

MIN_TOKEN_CHARS = 16
MAX_TOKEN_CHARS = 512


class TokenFileError(ValueError):
    """The token file cannot be used; the message names the file and line."""


class Tokens:
    """The tokens the coordinator accepts."""

    def __init__(self, swarm: list[str], per_peer: dict[str, str]):
        self.swarm = [t.encode() for t in swarm]
        self.per_peer = {p: t.encode() for p, t in per_peer.items()}

    @staticmethod
    def load(path: str | Path) -> "Tokens":
        try:
            lines = Path(path).read_text().splitlines()
        except (OSError, UnicodeDecodeError) as error:
            raise TokenFileError(f"cannot read the token file {path}: {error}") from None
        swarm, per_peer = [], {}
        for number, line in enumerate(lines, start=1):
            parts = line.split("#", 1)[0].split()
            if not parts:
                continue
            if len(parts) > 2 or (len(parts) == 2 and not is_peer_id(parts[0])):
                raise TokenFileError(f"{path}:{number}: expected '<token>' or '<peer id> <token>'")
            token = parts[-1]
            if not MIN_TOKEN_CHARS <= len(token) <= MAX_TOKEN_CHARS or not token.isprintable():
                raise TokenFileError(
                    f"{path}:{number}: a token has {MIN_TOKEN_CHARS} to {MAX_TOKEN_CHARS} printable "
                    "characters"
                )
            if len(parts) == 2:
                per_peer[parts[0]] = token
            else:
                swarm.append(token)
        if not swarm and not per_peer:
            raise TokenFileError(f"{path} holds no token")
        return Tokens(swarm, per_peer)

    def check(self, metadata: Metadata | None, peer_id: str | None) -> Refused | None:
        """None if the call may proceed; `peer_id` is the peer the call is about (None: no peer)."""
        presented = _bearer(metadata)
        if presented is None:
            return Refused("UNAUTHENTICATED", "missing 'authorization: Bearer <token>' metadata")
        if any(hmac.compare_digest(presented, token) for token in self.swarm):
            return None
        owner = next((p for p, t in self.per_peer.items() if hmac.compare_digest(presented, t)), None)
        if owner is None:
            return Refused("UNAUTHENTICATED", "unknown token")
        if peer_id is not None and owner != peer_id:
            return Refused("PERMISSION_DENIED", "this token belongs to another peer")
        return None


def _bearer(metadata: Metadata | None) -> bytes | None:
    for key, value in metadata or ():
        if key == "authorization":
            text = value if isinstance(value, str) else value.decode(errors="replace")
            scheme, _, token = text.partition(" ")
            if scheme.lower() == "bearer" and token and len(token) <= MAX_TOKEN_CHARS:
                return token.strip().encode()
    return None
