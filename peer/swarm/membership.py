"""Who may take part in a run: the run's configuration hash, the compatibility check that names the
setting that differs, and the signed, schema-checked DHT records peers heartbeat.

Records are protected the way hivemind protects its own: every record a peer writes sits under a
subkey carrying its public key, and the record is signed (shoal.peer.swarm.signing: Ed25519, derived
from the peer's identity; hivemind's `RSASignatureValidator` in the same role cost 642 more bytes
an entry), so no one else can overwrite it, and the run's fixed keys are checked against pydantic
models (`SchemaValidator`; hivemind 1.1.12 needs `pydantic.v1` models). A peer is identified by that
public-key subkey: it cannot be forged, unlike a peer id written inside a value.
"""

import hashlib
import json
from collections import Counter
from collections.abc import Mapping
from importlib.metadata import version
from typing import TYPE_CHECKING, TypeAlias

from hivemind.dht.schema import SchemaValidator
from hivemind.utils.crypto import RSAPrivateKey
from pydantic.v1 import BaseModel, StrictBool, StrictStr, confloat, conint, conlist, constr

from shoal.peer.swarm.names import check_run_name
from shoal.peer.swarm.signing import Ed25519RecordValidator, OwnerSubkey, owner_marker, record_key

SHOAL_VERSION = version("shoal")

# pydantic's constrained types: mypy (without pydantic's plugin) takes them as the values they hold
if TYPE_CHECKING:
    PeerIdStr: TypeAlias = str
    VersionStr: TypeAlias = str
    DeviceStr: TypeAlias = str
    CoordinatorStr: TypeAlias = str
    NonNegativeFloat: TypeAlias = float
    RoundSecondsFloat: TypeAlias = float
    EpochFloat: TypeAlias = float
    NonNegativeInt: TypeAlias = int
    RelayList: TypeAlias = list[str]
else:
    PeerIdStr = constr(strict=True, min_length=1, max_length=128)
    VersionStr = constr(strict=True, max_length=32)
    DeviceStr = constr(strict=True, max_length=64)
    CoordinatorStr = constr(strict=True, max_length=256)
    NonNegativeFloat = confloat(ge=0, strict=True)
    RoundSecondsFloat = confloat(gt=0, le=86400, strict=True)
    EpochFloat = confloat(ge=0, le=1e12, strict=True)
    NonNegativeInt = conint(ge=0, strict=True)
    RelayList = conlist(constr(strict=True, min_length=1, max_length=128), max_items=4)


class PeerRecord(BaseModel):
    """What a peer says about itself, refreshed every round."""

    peer_id: PeerIdStr  # base58 libp2p peer id, to pull payloads from
    version: VersionStr  # shoal version; major.minor must match
    config: dict[StrictStr, StrictStr]  # the configuration itself, to name what differs
    device: DeviceStr  # cpu, cuda:0, mps, ...
    throughput: NonNegativeFloat  # samples per second
    round: NonNegativeInt  # the round this record was written in
    start_time: NonNegativeFloat = 0.0  # the run's round clock: unix time round 0 starts
    round_seconds: RoundSecondsFloat = 60.0  # and how long a round lasts
    samples: NonNegativeInt = 0  # samples this peer has contributed since it started
    epoch: EpochFloat = 0.0  # the swarm's epoch over its data, with its share done
    tokens: NonNegativeInt = 0  # tokens the swarm consumed since the run began (its token ledger)
    updated: NonNegativeFloat = 0.0  # unix time the record was written
    coordinator: CoordinatorStr = ""  # the coordinator it follows, as it reaches it
    reachable: StrictBool | None = None  # whether a relay could dial it (None: not checked)
    relays: RelayList = []  # pull through these

    @property
    def run_hash(self) -> str:
        """sha256 of its configuration: not written (every reader derives it, and a record cannot claim
        one its configuration does not have), 76 bytes less in every record of every read."""
        return run_hash(self.config)


class RunRecords(BaseModel):
    """The run's fixed DHT keys (`<run>_<field>`): one entry per peer public key."""

    peers: dict[OwnerSubkey, PeerRecord | None]


def record_validators(run: str, identity: RSAPrivateKey) -> list:
    """What the DHT of a run must validate records with (pass to `start_dht(record_validators=...)`)."""
    return [
        SchemaValidator(RunRecords, prefix=check_run_name(run)),
        Ed25519RecordValidator(record_key(identity)),
    ]


def owner_subkey(identity: RSAPrivateKey) -> bytes:
    """The subkey that marks a record as written (and only writable) by `identity`."""
    return owner_marker(record_key(identity))


def run_hash(config: Mapping[str, str]) -> str:
    """sha256 over the configuration, canonically serialized."""
    return hashlib.sha256(json.dumps(dict(config), sort_keys=True).encode()).hexdigest()


def other_clock(mine: PeerRecord, theirs: PeerRecord) -> bool:
    """Whether `theirs` is a peer of this run (same shoal major.minor and configuration) on another
    round clock: two peers that started the run at once, each on its own clock."""
    same_version = mine.version.split(".")[:2] == theirs.version.split(".")[:2]
    clocks_differ = (mine.start_time, mine.round_seconds) != (theirs.start_time, theirs.round_seconds)
    return same_version and mine.run_hash == theirs.run_hash and clocks_differ


def winning_clock(clocks: Counter[tuple[float, float]]) -> tuple[float, float]:
    """The round clock (start time, round length) a run converges on, from how many live peers follow
    each: the most followed, ties to the earliest start, then the shorter rounds. Every peer that reads
    the same records picks the same clock."""
    return max(clocks, key=lambda clock: (clocks[clock], -clock[0], -clock[1]))


def incompatibility(mine: PeerRecord, theirs: PeerRecord) -> str | None:
    """Why a peer cannot take part in this peer's rounds, naming each differing setting; None if it can."""
    if mine.version.split(".")[:2] != theirs.version.split(".")[:2]:
        return f"shoal {theirs.version} there, {mine.version} here (major.minor must match)"
    if (mine.start_time, mine.round_seconds) != (theirs.start_time, theirs.round_seconds):
        return (
            f"round clock starts at {theirs.start_time} with {theirs.round_seconds} s rounds there, "
            f"{mine.start_time} with {mine.round_seconds} s here"
        )
    if mine.run_hash == theirs.run_hash:
        return None
    keys = sorted(mine.config.keys() | theirs.config.keys())
    differing = [k for k in keys if mine.config.get(k) != theirs.config.get(k)]
    return "; ".join(
        f"{k} is {theirs.config.get(k, 'the default')} there, {mine.config.get(k, 'the default')} here"
        for k in differing
    )
