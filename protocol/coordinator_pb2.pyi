from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class JoinRequest(_message.Message):
    __slots__ = ("peer_id", "throughput", "min_samples")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    THROUGHPUT_FIELD_NUMBER: _ClassVar[int]
    MIN_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    throughput: float
    min_samples: int
    def __init__(self, peer_id: _Optional[str] = ..., throughput: _Optional[float] = ..., min_samples: _Optional[int] = ...) -> None: ...

class JoinReply(_message.Message):
    __slots__ = ("round", "heartbeat_timeout_s", "now")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    NOW_FIELD_NUMBER: _ClassVar[int]
    round: int
    heartbeat_timeout_s: float
    now: float
    def __init__(self, round: _Optional[int] = ..., heartbeat_timeout_s: _Optional[float] = ..., now: _Optional[float] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("peer_id",)
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    def __init__(self, peer_id: _Optional[str] = ...) -> None: ...

class LeaveReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("peer_id", "round", "throughput", "min_samples", "exchange_s")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    THROUGHPUT_FIELD_NUMBER: _ClassVar[int]
    MIN_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    EXCHANGE_S_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    round: int
    throughput: float
    min_samples: int
    exchange_s: float
    def __init__(self, peer_id: _Optional[str] = ..., round: _Optional[int] = ..., throughput: _Optional[float] = ..., min_samples: _Optional[int] = ..., exchange_s: _Optional[float] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("compute_scale", "now")
    COMPUTE_SCALE_FIELD_NUMBER: _ClassVar[int]
    NOW_FIELD_NUMBER: _ClassVar[int]
    compute_scale: float
    now: float
    def __init__(self, compute_scale: _Optional[float] = ..., now: _Optional[float] = ...) -> None: ...

class RoundsRequest(_message.Message):
    __slots__ = ("peer_id",)
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    def __init__(self, peer_id: _Optional[str] = ...) -> None: ...

class RoundAnnouncement(_message.Message):
    __slots__ = ("round", "compute_deadline", "exchange_deadline", "data_seed", "peers", "now")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_DEADLINE_FIELD_NUMBER: _ClassVar[int]
    EXCHANGE_DEADLINE_FIELD_NUMBER: _ClassVar[int]
    DATA_SEED_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    NOW_FIELD_NUMBER: _ClassVar[int]
    round: int
    compute_deadline: float
    exchange_deadline: float
    data_seed: int
    peers: _containers.RepeatedScalarFieldContainer[str]
    now: float
    def __init__(self, round: _Optional[int] = ..., compute_deadline: _Optional[float] = ..., exchange_deadline: _Optional[float] = ..., data_seed: _Optional[int] = ..., peers: _Optional[_Iterable[str]] = ..., now: _Optional[float] = ...) -> None: ...

class ReportRequest(_message.Message):
    __slots__ = ("peer_id", "round", "digest", "size", "samples", "state", "synced")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    SYNCED_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    round: int
    digest: bytes
    size: int
    samples: int
    state: bytes
    synced: bool
    def __init__(self, peer_id: _Optional[str] = ..., round: _Optional[int] = ..., digest: _Optional[bytes] = ..., size: _Optional[int] = ..., samples: _Optional[int] = ..., state: _Optional[bytes] = ..., synced: _Optional[bool] = ...) -> None: ...

class ReportReply(_message.Message):
    __slots__ = ("included", "strikes", "compute_scale")
    INCLUDED_FIELD_NUMBER: _ClassVar[int]
    STRIKES_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SCALE_FIELD_NUMBER: _ClassVar[int]
    included: bool
    strikes: int
    compute_scale: float
    def __init__(self, included: _Optional[bool] = ..., strikes: _Optional[int] = ..., compute_scale: _Optional[float] = ...) -> None: ...

class RoundResultRequest(_message.Message):
    __slots__ = ("round",)
    ROUND_FIELD_NUMBER: _ClassVar[int]
    round: int
    def __init__(self, round: _Optional[int] = ...) -> None: ...

class Participant(_message.Message):
    __slots__ = ("peer_id", "digest", "size", "samples", "state", "synced")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    SYNCED_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    digest: bytes
    size: int
    samples: int
    state: bytes
    synced: bool
    def __init__(self, peer_id: _Optional[str] = ..., digest: _Optional[bytes] = ..., size: _Optional[int] = ..., samples: _Optional[int] = ..., state: _Optional[bytes] = ..., synced: _Optional[bool] = ...) -> None: ...

class StateVote(_message.Message):
    __slots__ = ("state", "synced", "count", "holders")
    STATE_FIELD_NUMBER: _ClassVar[int]
    SYNCED_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    HOLDERS_FIELD_NUMBER: _ClassVar[int]
    state: bytes
    synced: bool
    count: int
    holders: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, state: _Optional[bytes] = ..., synced: _Optional[bool] = ..., count: _Optional[int] = ..., holders: _Optional[_Iterable[str]] = ...) -> None: ...

class RoundResultReply(_message.Message):
    __slots__ = ("round", "participants", "stragglers", "exchange_deadline", "now", "votes", "reported")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    PARTICIPANTS_FIELD_NUMBER: _ClassVar[int]
    STRAGGLERS_FIELD_NUMBER: _ClassVar[int]
    EXCHANGE_DEADLINE_FIELD_NUMBER: _ClassVar[int]
    NOW_FIELD_NUMBER: _ClassVar[int]
    VOTES_FIELD_NUMBER: _ClassVar[int]
    REPORTED_FIELD_NUMBER: _ClassVar[int]
    round: int
    participants: _containers.RepeatedCompositeFieldContainer[Participant]
    stragglers: _containers.RepeatedScalarFieldContainer[str]
    exchange_deadline: float
    now: float
    votes: _containers.RepeatedCompositeFieldContainer[StateVote]
    reported: int
    def __init__(self, round: _Optional[int] = ..., participants: _Optional[_Iterable[_Union[Participant, _Mapping]]] = ..., stragglers: _Optional[_Iterable[str]] = ..., exchange_deadline: _Optional[float] = ..., now: _Optional[float] = ..., votes: _Optional[_Iterable[_Union[StateVote, _Mapping]]] = ..., reported: _Optional[int] = ...) -> None: ...

class SwarmStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class MemberStatus(_message.Message):
    __slots__ = ("peer_id", "throughput", "round", "strikes", "compute_scale", "silent_s")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    THROUGHPUT_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    STRIKES_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SCALE_FIELD_NUMBER: _ClassVar[int]
    SILENT_S_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    throughput: float
    round: int
    strikes: int
    compute_scale: float
    silent_s: float
    def __init__(self, peer_id: _Optional[str] = ..., throughput: _Optional[float] = ..., round: _Optional[int] = ..., strikes: _Optional[int] = ..., compute_scale: _Optional[float] = ..., silent_s: _Optional[float] = ...) -> None: ...

class SwarmStatusReply(_message.Message):
    __slots__ = ("round", "members", "compute_window_s", "exchange_window_s", "stragglers_total", "evictions_total", "now")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_WINDOW_S_FIELD_NUMBER: _ClassVar[int]
    EXCHANGE_WINDOW_S_FIELD_NUMBER: _ClassVar[int]
    STRAGGLERS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NOW_FIELD_NUMBER: _ClassVar[int]
    round: int
    members: _containers.RepeatedCompositeFieldContainer[MemberStatus]
    compute_window_s: float
    exchange_window_s: float
    stragglers_total: int
    evictions_total: int
    now: float
    def __init__(self, round: _Optional[int] = ..., members: _Optional[_Iterable[_Union[MemberStatus, _Mapping]]] = ..., compute_window_s: _Optional[float] = ..., exchange_window_s: _Optional[float] = ..., stragglers_total: _Optional[int] = ..., evictions_total: _Optional[int] = ..., now: _Optional[float] = ...) -> None: ...
