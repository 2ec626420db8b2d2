from bubblesnap.protos import daemon_pb2 as _daemon_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CopyRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    COPY_ROLE_UNSPECIFIED: _ClassVar[CopyRole]
    PRIMARY: _ClassVar[CopyRole]
    REPLICA: _ClassVar[CopyRole]
COPY_ROLE_UNSPECIFIED: CopyRole
PRIMARY: CopyRole
REPLICA: CopyRole

class JoinRequest(_message.Message):
    __slots__ = ("index", "address")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    index: int
    address: str
    def __init__(self, index: _Optional[int] = ..., address: _Optional[str] = ...) -> None: ...

class JoinResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HoldingsRequest(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: str
    def __init__(self, job: _Optional[str] = ...) -> None: ...

class HeldCopy(_message.Message):
    __slots__ = ("job", "rank", "step", "role", "world_size", "replica_group")
    JOB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    REPLICA_GROUP_FIELD_NUMBER: _ClassVar[int]
    job: str
    rank: int
    step: int
    role: CopyRole
    world_size: int
    replica_group: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, job: _Optional[str] = ..., rank: _Optional[int] = ..., step: _Optional[int] = ..., role: _Optional[_Union[CopyRole, str]] = ..., world_size: _Optional[int] = ..., replica_group: _Optional[_Iterable[int]] = ...) -> None: ...

class JobSteps(_message.Message):
    __slots__ = ("job", "steps")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    job: str
    steps: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, job: _Optional[str] = ..., steps: _Optional[_Iterable[int]] = ...) -> None: ...

class HoldingsResponse(_message.Message):
    __slots__ = ("index", "copies", "committed")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    COPIES_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    index: int
    copies: _containers.RepeatedCompositeFieldContainer[HeldCopy]
    committed: _containers.RepeatedCompositeFieldContainer[JobSteps]
    def __init__(self, index: _Optional[int] = ..., copies: _Optional[_Iterable[_Union[HeldCopy, _Mapping]]] = ..., committed: _Optional[_Iterable[_Union[JobSteps, _Mapping]]] = ...) -> None: ...

class ReplicateRequest(_message.Message):
    __slots__ = ("job", "world_size", "rank", "step", "tensors", "checksums", "data_address", "ticket", "replica_group")
    JOB_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    DATA_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    REPLICA_GROUP_FIELD_NUMBER: _ClassVar[int]
    job: str
    world_size: int
    rank: int
    step: int
    tensors: _containers.RepeatedCompositeFieldContainer[_daemon_pb2.TensorSpec]
    checksums: _containers.RepeatedScalarFieldContainer[int]
    data_address: str
    ticket: bytes
    replica_group: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, job: _Optional[str] = ..., world_size: _Optional[int] = ..., rank: _Optional[int] = ..., step: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[_daemon_pb2.TensorSpec, _Mapping]]] = ..., checksums: _Optional[_Iterable[int]] = ..., data_address: _Optional[str] = ..., ticket: _Optional[bytes] = ..., replica_group: _Optional[_Iterable[int]] = ...) -> None: ...

class ReplicateResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class OpenReadRequest(_message.Message):
    __slots__ = ("job", "rank", "step", "slots")
    JOB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    job: str
    rank: int
    step: int
    slots: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, job: _Optional[str] = ..., rank: _Optional[int] = ..., step: _Optional[int] = ..., slots: _Optional[_Iterable[int]] = ...) -> None: ...

class OpenReadResponse(_message.Message):
    __slots__ = ("ticket", "data_address", "segment_bytes", "checksums", "tensors", "world_size", "slots")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    DATA_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    ticket: bytes
    data_address: str
    segment_bytes: int
    checksums: _containers.RepeatedScalarFieldContainer[int]
    tensors: _containers.RepeatedCompositeFieldContainer[_daemon_pb2.TensorSpec]
    world_size: int
    slots: _containers.RepeatedCompositeFieldContainer[_daemon_pb2.Slot]
    def __init__(self, ticket: _Optional[bytes] = ..., data_address: _Optional[str] = ..., segment_bytes: _Optional[int] = ..., checksums: _Optional[_Iterable[int]] = ..., tensors: _Optional[_Iterable[_Union[_daemon_pb2.TensorSpec, _Mapping]]] = ..., world_size: _Optional[int] = ..., slots: _Optional[_Iterable[_Union[_daemon_pb2.Slot, _Mapping]]] = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ("job", "rank", "step")
    JOB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    job: str
    rank: int
    step: int
    def __init__(self, job: _Optional[str] = ..., rank: _Optional[int] = ..., step: _Optional[int] = ...) -> None: ...

class LayoutsRequest(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: str
    def __init__(self, job: _Optional[str] = ...) -> None: ...

class RankLayout(_message.Message):
    __slots__ = ("rank", "world_size", "tensors", "replica_group")
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_GROUP_FIELD_NUMBER: _ClassVar[int]
    rank: int
    world_size: int
    tensors: _containers.RepeatedCompositeFieldContainer[_daemon_pb2.TensorSpec]
    replica_group: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, rank: _Optional[int] = ..., world_size: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[_daemon_pb2.TensorSpec, _Mapping]]] = ..., replica_group: _Optional[_Iterable[int]] = ...) -> None: ...

class LayoutsResponse(_message.Message):
    __slots__ = ("ranks",)
    RANKS_FIELD_NUMBER: _ClassVar[int]
    ranks: _containers.RepeatedCompositeFieldContainer[RankLayout]
    def __init__(self, ranks: _Optional[_Iterable[_Union[RankLayout, _Mapping]]] = ...) -> None: ...

class RollbackRequest(_message.Message):
    __slots__ = ("job", "step", "world_size", "resume")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    job: str
    step: int
    world_size: int
    resume: bool
    def __init__(self, job: _Optional[str] = ..., step: _Optional[int] = ..., world_size: _Optional[int] = ..., resume: _Optional[bool] = ...) -> None: ...

class ResumeStepRequest(_message.Message):
    __slots__ = ("job", "world_size", "rank")
    JOB_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    job: str
    world_size: int
    rank: int
    def __init__(self, job: _Optional[str] = ..., world_size: _Optional[int] = ..., rank: _Optional[int] = ...) -> None: ...

class ResumeStepResponse(_message.Message):
    __slots__ = ("step",)
    STEP_FIELD_NUMBER: _ClassVar[int]
    step: int
    def __init__(self, step: _Optional[int] = ...) -> None: ...

class RollbackResponse(_message.Message):
    __slots__ = ("dropped_copies",)
    DROPPED_COPIES_FIELD_NUMBER: _ClassVar[int]
    dropped_copies: int
    def __init__(self, dropped_copies: _Optional[int] = ...) -> None: ...

class LogReplicaRequest(_message.Message):
    __slots__ = ("job", "rank", "records")
    JOB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    job: str
    rank: int
    records: _containers.RepeatedCompositeFieldContainer[_daemon_pb2.LogRecord]
    def __init__(self, job: _Optional[str] = ..., rank: _Optional[int] = ..., records: _Optional[_Iterable[_Union[_daemon_pb2.LogRecord, _Mapping]]] = ...) -> None: ...

class LogReplicaResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
