"""A trust anchor for peers that hold no verified state: the run key signs the state of each round.

A peer in sync keeps the state it computed whatever a headcount says, and its vote weighs what the
rounds it verified record (shoal.protocol.work). A peer with nothing verified (a joiner, a peer restarted
from a checkpoint) has no such record: every identity weighs nothing to it, so the announcers'
headcount decides, and identities cost nothing. No rule inside the swarm can tell such a peer which of
two states announced as "in sync" is the one the run computed: proof-of-stake chains meet the same
problem and answer it with a checkpoint from a source the newcomer already trusts ("weak
subjectivity", Buterin 2014). shoal's is the run's starter:

- the peer that starts a run (no --initial-peers) holds the *run key*, its identity's Ed25519 record
  key (shoal.peer.swarm.signing); the join command it prints names it (`--trust-key`), and every peer
  started from that command prints it again;
- each round it is in sync, the run key's holder writes (round, state digest) under the run's anchor
  key (`names.anchor_key`), under its own subkey: every DHT node, and the reader, checks that only the
  run key signed that entry (signing.Ed25519RecordValidator);
- a peer given `--trust-key` and not in sync takes only the state the run key signed for the round
  (`RoundStages.agree`); until there is one (the starter away, or out of sync itself) it waits, counted
  `unanchored_state`, rather than take a headcount's. Once in sync it follows the rules of every peer in
  sync, and earns what it verifies.

Under a coordinator the run key neither signs nor is asked: the coordinator admits the peers (per-peer
tokens) and counts the vote, weighed by counted work (shoal.coordinator.replies).

Without `--trust-key` a joiner takes the headcount's state, as before: the default for a swarm whose
join command did not come from its starter. `--trust-key` is a 64-digit hex key, checked before the peer
starts; what the DHT returns under the anchor key is another peer's data, checked here (`parse_anchor`).
"""

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from hivemind.utils.logging import get_logger

from shoal.peer.swarm.counters import SwarmCounters
from shoal.peer.swarm.directory import RunDirectory
from shoal.peer.swarm.names import anchor_key
from shoal.peer.swarm.signing import KEY_BYTES
from shoal.peer.swarm.state import DIGEST_BYTES

logger = get_logger(__name__)

MAX_ROUND = 1 << 62


def public_key(key: Ed25519PrivateKey) -> bytes:
    """The 32 raw bytes of `key`'s public half: the run key, when `key` is the starter's record key."""
    return key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def parse_anchor(value: object) -> tuple[int, bytes] | None:
    """(round, state digest) from an anchor entry's value, another peer's data; None if malformed."""
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        return None
    number, digest = value
    if not isinstance(number, int) or isinstance(number, bool) or not 0 <= number < MAX_ROUND:
        return None
    if not isinstance(digest, bytes) or len(digest) != DIGEST_BYTES:
        return None
    return number, digest


class Anchor:
    """The run key's side (`sign`) and a trusting peer's (`signed`) of the module docstring, over the
    run's directory. `trust`: the run key (None: this peer trusts no key); `signs`: this peer holds it."""

    def __init__(self, directory: RunDirectory, counts: SwarmCounters, *, trust: bytes | None, signs: bool):
        if trust is not None and len(trust) != KEY_BYTES:
            raise ValueError(f"a run key is {KEY_BYTES} bytes, got {len(trust)}")
        self.directory, self.counts, self.trust, self.signs = directory, counts, trust, signs
        self.key = anchor_key(directory.run)
        self._subkey = None if trust is None else b"[ed25519:" + trust + b"]"
        self._told = -1  # the last round a wait was logged

    @property
    def verifies(self) -> bool:
        """Whether this peer, out of sync, takes only a signed state."""
        return self.trust is not None and not self.signs

    async def sign(self, number: int, digest: bytes, expiration: float) -> None:
        """Signs `digest` as the shared state of round `number` (this peer holds the run key, in sync)."""
        await self.directory.store(self.key, [number, digest], expiration)

    async def signed(self, number: int, *, quiet: bool = False) -> bytes | None:
        """The state the run key signed for round `number`; None (counted, and told now and then, unless
        `quiet`) if it signed none, or an older round's."""
        found = await self.directory.get(self.key, every_rounds=0.0, fully=True)
        entries = found.value if found is not None and isinstance(found.value, dict) else {}
        entry = entries.get(self._subkey)
        anchor = parse_anchor(getattr(entry, "value", None)) if entry is not None else None
        if entry is not None and anchor is None:
            self.counts.rejected["bad_anchor"] += 1
        if anchor is not None and anchor[0] == number:
            return anchor[1]
        if quiet:
            return None
        self.counts.rejected["unanchored_state"] += 1
        if number - self._told >= 10:
            self._told = number
            last = "no round yet" if anchor is None else f"round {anchor[0]} last"
            logger.warning(
                f"the run key signed no state for round {number} ({last}): this peer takes no state "
                "until it does (is the run's starter up, and in sync?)"
            )
        return None
