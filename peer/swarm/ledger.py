"""Ledger: what a peer holds against the others (a part of SwarmExchange, shoal.peer.swarm.exchange).

- Strikes: a payload that does not match its announcement, one that the optimizer drops (malformed,
  another configuration, screened out), an announcement never served, a replay. After `strike_limit`
  strikes a peer is banned: its announcements are ignored for `ban_rounds` rounds.
- Replays: a payload digest already announced in an earlier round is refused, and so is a payload
  whose content (`content_digest`: unknown fields dropped, serialized deterministically) came in an
  earlier round under another encoding.

A ban lasts `ban_rounds` from the round that brought it, not from wherever this peer is now, so
that peers that struck for the same rounds lift it in the same round (one that lifted it a round
earlier would take a payload the others ignore, and end a run on another model).

Touched only on the exchange's event loop thread.
"""

import hashlib
from collections import Counter

from google.protobuf.message import DecodeError
from hivemind.utils.logging import get_logger

from shoal.peer.swarm.counters import SwarmCounters
from shoal.peer.swarm.records import Announcement
from shoal.protocol import MalformedPayloadError, Payload

logger = get_logger(__name__)

REMEMBERED_ROUNDS = 16  # digests and contents are remembered this many rounds, to refuse replays


class Ledger:
    """See the module docstring. `me`: this peer's public-key subkey (never struck)."""

    def __init__(self, me: bytes, counts: SwarmCounters, *, strike_limit: int, ban_rounds: int):
        self.me, self.counts = me, counts
        self.strike_limit, self.ban_rounds = strike_limit, ban_rounds
        self.strikes: Counter[bytes] = Counter()
        """Strikes per peer (public-key subkey) since its last ban."""
        self.banned: dict[bytes, int] = {}
        """Banned peers and the first round they are heard again."""
        self._seen: dict[bytes, int] = {}  # payload digest: the round it was first announced in
        self._seen_content: dict[bytes, int] = {}  # content_digest of a payload: the round it came in

    def strike(self, owner: bytes, reason: str, round_number: int) -> None:
        """A strike for what `owner` sent in `round_number` (`reason` for the log)."""
        if not owner or owner == self.me:
            return
        self.strikes[owner] += 1
        self.counts.strikes_total += 1
        if self.strikes[owner] >= self.strike_limit:
            logger.warning(
                f"ignoring a peer for {self.ban_rounds} rounds after {self.strikes[owner]} strikes ({reason})"
            )
            self.banned[owner] = round_number + 1 + self.ban_rounds
            del self.strikes[owner]

    def refuse(self, owner: bytes, reason: str, round_number: int) -> None:
        """Counts a refusal of what `owner` sent in `round_number` (`reason`), and strikes it."""
        self.counts.rejected[reason] += 1
        self.strike(owner, reason, round_number)

    def new_round(self, round_number: int) -> None:
        """Lifts the bans that end by `round_number`; forgets digests too old to be replayed."""
        for seen in (self._seen, self._seen_content):
            for key in [
                k for k, first_round in seen.items() if first_round < round_number - REMEMBERED_ROUNDS
            ]:
                del seen[key]
        self.banned = {owner: until for owner, until in self.banned.items() if until > round_number}

    def announced(self, digest: bytes, round_number: int) -> None:
        """This peer's own payload of `round_number`: another peer sending it later replays it."""
        self._seen.setdefault(digest, round_number)

    def refusal(
        self, round_number: int, owner: bytes, announcement: Announcement | MalformedPayloadError
    ) -> str | None:
        """Why an announcement of a compatible peer (`owner`), or what was under its subkey instead, is
        not taken (None: it is)."""
        if owner in self.banned:
            return "banned"
        if isinstance(announcement, MalformedPayloadError):
            return announcement.reason
        return "replayed" if self._seen.setdefault(announcement.digest, round_number) < round_number else None

    def replayed_content(self, data: bytes, round_number: int) -> bool:
        """Whether a payload pulled in `round_number` is an earlier round's, re-encoded (an unknown field
        appended, fields reordered): its digest is new, its content is not."""
        content = content_digest(data)
        return content is not None and self._seen_content.setdefault(content, round_number) < round_number


def content_digest(data: bytes) -> bytes | None:
    """SHA-256 of a payload's canonical form (unknown fields and the ledger claim dropped,
    deterministic serialization): the same for every encoding of the same tensors. None when `data`
    is no Payload of tensors (a `mean`'s part): nothing to compare."""
    message = Payload()
    try:
        message.ParseFromString(data)
    except DecodeError:
        return None
    message.DiscardUnknownFields()
    message.ClearField("trained")  # the token ledger's claim: a replay may carry a fresh one
    if not message.tensors:
        return None
    return hashlib.sha256(message.SerializeToString(deterministic=True)).digest()
