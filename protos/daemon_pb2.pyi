from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CopyState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    COPY_STATE_UNSPECIFIED: _ClassVar[CopyState]
    STAGING: _ClassVar[CopyState]
    LOCAL: _ClassVar[CopyState]
COPY_STATE_UNSPECIFIED: CopyState
STAGING: CopyState
LOCAL: CopyState

class Slice(_message.Message):
    __slots__ = ("start", "stop")
    START_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    start: int
    stop: int
    def __init__(self, start: _Optional[int] = ..., stop: _Optional[int] = ...) -> None: ...

class ShardSpec(_message.Message):
    __slots__ = ("index", "nbytes", "device")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    index: _containers.RepeatedCompositeFieldContainer[Slice]
    nbytes: int
    device: str
    def __init__(self, index: _Optional[_Iterable[_Union[Slice, _Mapping]]] = ..., nbytes: _Optional[int] = ..., device: _Optional[str] = ...) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("name", "dtype", "global_shape", "shards", "job_wide")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_SHAPE_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    JOB_WIDE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    global_shape: _containers.RepeatedScalarFieldContainer[int]
    shards: _containers.RepeatedCompositeFieldContainer[ShardSpec]
    job_wide: bool
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., global_shape: _Optional[_Iterable[int]] = ..., shards: _Optional[_Iterable[_Union[ShardSpec, _Mapping]]] = ..., job_wide: _Optional[bool] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("job", "rank", "world_size", "tensors", "replica_group")
    JOB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_GROUP_FIELD_NUMBER: _ClassVar[int]
    job: str
    rank: int
    world_size: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    replica_group: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, job: _Optional[str] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., replica_group: _Optional[_Iterable[int]] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("reattached", "latest_local_step", "step_bytes", "heartbeat_path")
    REATTACHED_FIELD_NUMBER: _ClassVar[int]
    LATEST_LOCAL_STEP_FIELD_NUMBER: _ClassVar[int]
    STEP_BYTES_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_PATH_FIELD_NUMBER: _ClassVar[int]
    reattached: bool
    latest_local_step: int
    step_bytes: int
    heartbeat_path: str
    def __init__(self, reattached: _Optional[bool] = ..., latest_local_step: _Optional[int] = ..., step_bytes: _Optional[int] = ..., heartbeat_path: _Optional[str] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("tensor", "shard", "start", "stop")
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    tensor: int
    shard: int
    start: int
    stop: int
    def __init__(self, tensor: _Optional[int] = ..., shard: _Optional[int] = ..., start: _Optional[int] = ..., stop: _Optional[int] = ...) -> None: ...

class BubbleReport(_message.Message):
    __slots__ = ("position", "measured_seconds", "copied_bytes", "copy_seconds")
    POSITION_FIELD_NUMBER: _ClassVar[int]
    MEASURED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COPIED_BYTES_FIELD_NUMBER: _ClassVar[int]
    COPY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    position: int
    measured_seconds: float
    copied_bytes: int
    copy_seconds: float
    def __init__(self, position: _Optional[int] = ..., measured_seconds: _Optional[float] = ..., copied_bytes: _Optional[int] = ..., copy_seconds: _Optional[float] = ...) -> None: ...

class BubbleEvent(_message.Message):
    __slots__ = ("job", "rank", "stage", "step", "kind", "expected_seconds", "plan_version", "iteration", "position", "measured_seconds", "copied_bytes", "copy_seconds", "iteration_seconds", "reports")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[BubbleEvent.Kind]
        START: _ClassVar[BubbleEvent.Kind]
        END: _ClassVar[BubbleEvent.Kind]
        REPORT: _ClassVar[BubbleEvent.Kind]
    KIND_UNSPECIFIED: BubbleEvent.Kind
    START: BubbleEvent.Kind
    END: BubbleEvent.Kind
    REPORT: BubbleEvent.Kind
    JOB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PLAN_VERSION_FIELD_NUMBER: _ClassVar[int]
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    MEASURED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COPIED_BYTES_FIELD_NUMBER: _ClassVar[int]
    COPY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ITERATION_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REPORTS_FIELD_NUMBER: _ClassVar[int]
    job: str
    rank: int
    stage: int
    step: int
    kind: BubbleEvent.Kind
    expected_seconds: float
    plan_version: int
    iteration: int
    position: int
    measured_seconds: float
    copied_bytes: int
    copy_seconds: float
    iteration_seconds: float
    reports: _containers.RepeatedCompositeFieldContainer[BubbleReport]
    def __init__(self, job: _Optional[str] = ..., rank: _Optional[int] = ..., stage: _Optional[int] = ..., step: _Optional[int] = ..., kind: _Optional[_Union[BubbleEvent.Kind, str]] = ..., expected_seconds: _Optional[float] = ..., plan_version: _Optional[int] = ..., iteration: _Optional[int] = ..., position: _Optional[int] = ..., measured_seconds: _Optional[float] = ..., copied_bytes: _Optional[int] = ..., copy_seconds: _Optional[float] = ..., iteration_seconds: _Optional[float] = ..., reports: _Optional[_Iterable[_Union[BubbleReport, _Mapping]]] = ...) -> None: ...

class Assignment(_message.Message):
    __slots__ = ("offset", "position", "chunks", "commit")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    offset: int
    position: int
    chunks: _containers.RepeatedCompositeFieldContainer[Chunk]
    commit: bool
    def __init__(self, offset: _Optional[int] = ..., position: _Optional[int] = ..., chunks: _Optional[_Iterable[_Union[Chunk, _Mapping]]] = ..., commit: _Optional[bool] = ...) -> None: ...

class FetchPlan(_message.Message):
    __slots__ = ("interval", "plan_version", "assignments", "first_step")
    INTERVAL_FIELD_NUMBER: _ClassVar[int]
    PLAN_VERSION_FIELD_NUMBER: _ClassVar[int]
    ASSIGNMENTS_FIELD_NUMBER: _ClassVar[int]
    FIRST_STEP_FIELD_NUMBER: _ClassVar[int]
    interval: int
    plan_version: int
    assignments: _containers.RepeatedCompositeFieldContainer[Assignment]
    first_step: int
    def __init__(self, interval: _Optional[int] = ..., plan_version: _Optional[int] = ..., assignments: _Optional[_Iterable[_Union[Assignment, _Mapping]]] = ..., first_step: _Optional[int] = ...) -> None: ...

class Slot(_message.Message):
    __slots__ = ("tensor", "shard", "offset", "nbytes", "segment")
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    tensor: int
    shard: int
    offset: int
    nbytes: int
    segment: int
    def __init__(self, tensor: _Optional[int] = ..., shard: _Optional[int] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ..., segment: _Optional[int] = ...) -> None: ...

class BeginStepRequest(_message.Message):
    __slots__ = ("job", "rank", "step")
    JOB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    job: str
    rank: int
    step: int
    def __init__(self, job: _Optional[str] = ..., rank: _Optional[int] = ..., step: _Optional[int] = ...) -> None: ...

class BeginStepResponse(_message.Message):
    __slots__ = ("segment_path", "segment_bytes", "slots")
    SEGMENT_PATH_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    segment_path: str
    segment_bytes: int
    slots: _containers.RepeatedCompositeFieldContainer[Slot]
    def __init__(self, segment_path: _Optional[str] = ..., segment_bytes: _Optional[int] = ..., slots: _Optional[_Iterable[_Union[Slot, _Mapping]]] = ...) -> None: ...

class BubbleUsage(_message.Message):
    __slots__ = ("offered_seconds", "used_seconds", "spilled_seconds", "spilled_bytes", "bubbles", "iterations", "overrun_seconds")
    OFFERED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    USED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SPILLED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SPILLED_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUBBLES_FIELD_NUMBER: _ClassVar[int]
    ITERATIONS_FIELD_NUMBER: _ClassVar[int]
    OVERRUN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    offered_seconds: float
    used_seconds: float
    spilled_seconds: float
    spilled_bytes: int
    bubbles: int
    iterations: int
    overrun_seconds: float
    def __init__(self, offered_seconds: _Optional[float] = ..., used_seconds: _Optional[float] = ..., spilled_seconds: _Optional[float] = ..., spilled_bytes: _Optional[int] = ..., bubbles: _Optional[int] = ..., iterations: _Optional[int] = ..., overrun_seconds: _Optional[float] = ...) -> None: ...

class CommitStepRequest(_message.Message):
    __slots__ = ("job", "rank", "step", "checksums", "usage", "next_step", "staged_as")
    JOB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    NEXT_STEP_FIELD_NUMBER: _ClassVar[int]
    STAGED_AS_FIELD_NUMBER: _ClassVar[int]
    job: str
    rank: int
    step: int
    checksums: _containers.RepeatedScalarFieldContainer[int]
    usage: BubbleUsage
    next_step: int
    staged_as: int
    def __init__(self, job: _Optional[str] = ..., rank: _Optional[int] = ..., step: _Optional[int] = ..., checksums: _Optional[_Iterable[int]] = ..., usage: _Optional[_Union[BubbleUsage, _Mapping]] = ..., next_step: _Optional[int] = ..., staged_as: _Optional[int] = ...) -> None: ...

class CommitStepResponse(_message.Message):
    __slots__ = ("job_committed", "latest_committed_step", "next")
    JOB_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    LATEST_COMMITTED_STEP_FIELD_NUMBER: _ClassVar[int]
    NEXT_FIELD_NUMBER: _ClassVar[int]
    job_committed: bool
    latest_committed_step: int
    next: BeginStepResponse
    def __init__(self, job_committed: _Optional[bool] = ..., latest_committed_step: _Optional[int] = ..., next: _Optional[_Union[BeginStepResponse, _Mapping]] = ...) -> None: ...

class AbortStepRequest(_message.Message):
    __slots__ = ("job", "rank", "step")
    JOB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    job: str
    rank: int
    step: int
    def __init__(self, job: _Optional[str] = ..., rank: _Optional[int] = ..., step: _Optional[int] = ...) -> None: ...

class AbortStepResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: str
    def __init__(self, job: _Optional[str] = ...) -> None: ...

class ShardStatus(_message.Message):
    __slots__ = ("tensor", "shard", "nbytes", "checksum")
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    tensor: str
    shard: int
    nbytes: int
    checksum: int
    def __init__(self, tensor: _Optional[str] = ..., shard: _Optional[int] = ..., nbytes: _Optional[int] = ..., checksum: _Optional[int] = ...) -> None: ...

class RankStepStatus(_message.Message):
    __slots__ = ("rank", "state", "nbytes", "shards", "usage", "replica", "copies", "durable", "held_for")
    RANK_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    COPIES_FIELD_NUMBER: _ClassVar[int]
    DURABLE_FIELD_NUMBER: _ClassVar[int]
    HELD_FOR_FIELD_NUMBER: _ClassVar[int]
    rank: int
    state: CopyState
    nbytes: int
    shards: _containers.RepeatedCompositeFieldContainer[ShardStatus]
    usage: BubbleUsage
    replica: bool
    copies: int
    durable: bool
    held_for: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, rank: _Optional[int] = ..., state: _Optional[_Union[CopyState, str]] = ..., nbytes: _Optional[int] = ..., shards: _Optional[_Iterable[_Union[ShardStatus, _Mapping]]] = ..., usage: _Optional[_Union[BubbleUsage, _Mapping]] = ..., replica: _Optional[bool] = ..., copies: _Optional[int] = ..., durable: _Optional[bool] = ..., held_for: _Optional[_Iterable[int]] = ...) -> None: ...

class StepStatus(_message.Message):
    __slots__ = ("step", "committed", "ranks")
    STEP_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    step: int
    committed: bool
    ranks: _containers.RepeatedCompositeFieldContainer[RankStepStatus]
    def __init__(self, step: _Optional[int] = ..., committed: _Optional[bool] = ..., ranks: _Optional[_Iterable[_Union[RankStepStatus, _Mapping]]] = ...) -> None: ...

class CorruptCopy(_message.Message):
    __slots__ = ("rank", "step", "source", "detail", "unix_time")
    RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    UNIX_TIME_FIELD_NUMBER: _ClassVar[int]
    rank: int
    step: int
    source: str
    detail: str
    unix_time: float
    def __init__(self, rank: _Optional[int] = ..., step: _Optional[int] = ..., source: _Optional[str] = ..., detail: _Optional[str] = ..., unix_time: _Optional[float] = ...) -> None: ...

class RankPlan(_message.Message):
    __slots__ = ("rank", "bubbles", "bubble_seconds", "copy_bytes_per_second", "step_bytes", "predicted_overhead", "planned_spill_bytes")
    RANK_FIELD_NUMBER: _ClassVar[int]
    BUBBLES_FIELD_NUMBER: _ClassVar[int]
    BUBBLE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COPY_BYTES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    STEP_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_OVERHEAD_FIELD_NUMBER: _ClassVar[int]
    PLANNED_SPILL_BYTES_FIELD_NUMBER: _ClassVar[int]
    rank: int
    bubbles: int
    bubble_seconds: float
    copy_bytes_per_second: float
    step_bytes: int
    predicted_overhead: float
    planned_spill_bytes: int
    def __init__(self, rank: _Optional[int] = ..., bubbles: _Optional[int] = ..., bubble_seconds: _Optional[float] = ..., copy_bytes_per_second: _Optional[float] = ..., step_bytes: _Optional[int] = ..., predicted_overhead: _Optional[float] = ..., planned_spill_bytes: _Optional[int] = ...) -> None: ...

class PlanStatus(_message.Message):
    __slots__ = ("interval", "version", "predicted_overhead", "ranks")
    INTERVAL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_OVERHEAD_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    interval: int
    version: int
    predicted_overhead: float
    ranks: _containers.RepeatedCompositeFieldContainer[RankPlan]
    def __init__(self, interval: _Optional[int] = ..., version: _Optional[int] = ..., predicted_overhead: _Optional[float] = ..., ranks: _Optional[_Iterable[_Union[RankPlan, _Mapping]]] = ...) -> None: ...

class JobStatus(_message.Message):
    __slots__ = ("job", "world_size", "registered_ranks", "latest_committed_step", "steps", "plan", "replicas", "durable_steps", "corrupt_copies", "coverage", "replication")
    JOB_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_RANKS_FIELD_NUMBER: _ClassVar[int]
    LATEST_COMMITTED_STEP_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    DURABLE_STEPS_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_COPIES_FIELD_NUMBER: _ClassVar[int]
    COVERAGE_FIELD_NUMBER: _ClassVar[int]
    REPLICATION_FIELD_NUMBER: _ClassVar[int]
    job: str
    world_size: int
    registered_ranks: _containers.RepeatedScalarFieldContainer[int]
    latest_committed_step: int
    steps: _containers.RepeatedCompositeFieldContainer[StepStatus]
    plan: PlanStatus
    replicas: int
    durable_steps: _containers.RepeatedScalarFieldContainer[int]
    corrupt_copies: _containers.RepeatedCompositeFieldContainer[CorruptCopy]
    coverage: Coverage
    replication: _containers.RepeatedCompositeFieldContainer[Replication]
    def __init__(self, job: _Optional[str] = ..., world_size: _Optional[int] = ..., registered_ranks: _Optional[_Iterable[int]] = ..., latest_committed_step: _Optional[int] = ..., steps: _Optional[_Iterable[_Union[StepStatus, _Mapping]]] = ..., plan: _Optional[_Union[PlanStatus, _Mapping]] = ..., replicas: _Optional[int] = ..., durable_steps: _Optional[_Iterable[int]] = ..., corrupt_copies: _Optional[_Iterable[_Union[CorruptCopy, _Mapping]]] = ..., coverage: _Optional[_Union[Coverage, _Mapping]] = ..., replication: _Optional[_Iterable[_Union[Replication, _Mapping]]] = ...) -> None: ...

class Replication(_message.Message):
    __slots__ = ("rank", "step", "nbytes", "paced", "peers", "waited_seconds", "push_seconds", "idle_bytes", "copies_seconds")
    RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    PACED_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    WAITED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PUSH_SECONDS_FIELD_NUMBER: _ClassVar[int]
    IDLE_BYTES_FIELD_NUMBER: _ClassVar[int]
    COPIES_SECONDS_FIELD_NUMBER: _ClassVar[int]
    rank: int
    step: int
    nbytes: int
    paced: bool
    peers: int
    waited_seconds: float
    push_seconds: float
    idle_bytes: int
    copies_seconds: float
    def __init__(self, rank: _Optional[int] = ..., step: _Optional[int] = ..., nbytes: _Optional[int] = ..., paced: _Optional[bool] = ..., peers: _Optional[int] = ..., waited_seconds: _Optional[float] = ..., push_seconds: _Optional[float] = ..., idle_bytes: _Optional[int] = ..., copies_seconds: _Optional[float] = ...) -> None: ...

class Coverage(_message.Message):
    __slots__ = ("whole", "known", "missing")
    WHOLE_FIELD_NUMBER: _ClassVar[int]
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    whole: bool
    known: bool
    missing: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, whole: _Optional[bool] = ..., known: _Optional[bool] = ..., missing: _Optional[_Iterable[str]] = ...) -> None: ...

class MemoryStatus(_message.Message):
    __slots__ = ("budget_bytes", "used_bytes", "pooled_bytes", "shm_dir", "shm_free_bytes", "log_bytes", "log_budget_bytes", "warm_bytes", "warm_pool_bytes", "warm_segments_taken", "shm_filesystem", "shm_huge", "shm_page_bytes")
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    POOLED_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHM_DIR_FIELD_NUMBER: _ClassVar[int]
    SHM_FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOG_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOG_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    WARM_BYTES_FIELD_NUMBER: _ClassVar[int]
    WARM_POOL_BYTES_FIELD_NUMBER: _ClassVar[int]
    WARM_SEGMENTS_TAKEN_FIELD_NUMBER: _ClassVar[int]
    SHM_FILESYSTEM_FIELD_NUMBER: _ClassVar[int]
    SHM_HUGE_FIELD_NUMBER: _ClassVar[int]
    SHM_PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    budget_bytes: int
    used_bytes: int
    pooled_bytes: int
    shm_dir: str
    shm_free_bytes: int
    log_bytes: int
    log_budget_bytes: int
    warm_bytes: int
    warm_pool_bytes: int
    warm_segments_taken: int
    shm_filesystem: str
    shm_huge: str
    shm_page_bytes: int
    def __init__(self, budget_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., pooled_bytes: _Optional[int] = ..., shm_dir: _Optional[str] = ..., shm_free_bytes: _Optional[int] = ..., log_bytes: _Optional[int] = ..., log_budget_bytes: _Optional[int] = ..., warm_bytes: _Optional[int] = ..., warm_pool_bytes: _Optional[int] = ..., warm_segments_taken: _Optional[int] = ..., shm_filesystem: _Optional[str] = ..., shm_huge: _Optional[str] = ..., shm_page_bytes: _Optional[int] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("jobs", "memory", "adoption", "in_flight", "durable_directory", "durable_error", "durable_notes")
    JOBS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    ADOPTION_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    DURABLE_DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    DURABLE_ERROR_FIELD_NUMBER: _ClassVar[int]
    DURABLE_NOTES_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[JobStatus]
    memory: MemoryStatus
    adoption: Adoption
    in_flight: _containers.RepeatedCompositeFieldContainer[InFlight]
    durable_directory: str
    durable_error: str
    durable_notes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, jobs: _Optional[_Iterable[_Union[JobStatus, _Mapping]]] = ..., memory: _Optional[_Union[MemoryStatus, _Mapping]] = ..., adoption: _Optional[_Union[Adoption, _Mapping]] = ..., in_flight: _Optional[_Iterable[_Union[InFlight, _Mapping]]] = ..., durable_directory: _Optional[str] = ..., durable_error: _Optional[str] = ..., durable_notes: _Optional[_Iterable[str]] = ...) -> None: ...

class InFlight(_message.Message):
    __slots__ = ("kind", "job", "rank", "step", "done_bytes", "total_bytes", "seconds")
    KIND_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    DONE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    kind: str
    job: str
    rank: int
    step: int
    done_bytes: int
    total_bytes: int
    seconds: float
    def __init__(self, kind: _Optional[str] = ..., job: _Optional[str] = ..., rank: _Optional[int] = ..., step: _Optional[int] = ..., done_bytes: _Optional[int] = ..., total_bytes: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class Adoption(_message.Message):
    __slots__ = ("directories", "adopted", "adopted_bytes", "dropped", "dropped_bytes", "kept", "seconds")
    DIRECTORIES_FIELD_NUMBER: _ClassVar[int]
    ADOPTED_FIELD_NUMBER: _ClassVar[int]
    ADOPTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_BYTES_FIELD_NUMBER: _ClassVar[int]
    KEPT_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    directories: _containers.RepeatedScalarFieldContainer[str]
    adopted: _containers.RepeatedCompositeFieldContainer[AdoptedCopy]
    adopted_bytes: int
    dropped: _containers.RepeatedCompositeFieldContainer[LeftFile]
    dropped_bytes: int
    kept: _containers.RepeatedCompositeFieldContainer[LeftFile]
    seconds: float
    def __init__(self, directories: _Optional[_Iterable[str]] = ..., adopted: _Optional[_Iterable[_Union[AdoptedCopy, _Mapping]]] = ..., adopted_bytes: _Optional[int] = ..., dropped: _Optional[_Iterable[_Union[LeftFile, _Mapping]]] = ..., dropped_bytes: _Optional[int] = ..., kept: _Optional[_Iterable[_Union[LeftFile, _Mapping]]] = ..., seconds: _Optional[float] = ...) -> None: ...

class AdoptedCopy(_message.Message):
    __slots__ = ("job", "rank", "step", "nbytes", "replica")
    JOB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    job: str
    rank: int
    step: int
    nbytes: int
    replica: bool
    def __init__(self, job: _Optional[str] = ..., rank: _Optional[int] = ..., step: _Optional[int] = ..., nbytes: _Optional[int] = ..., replica: _Optional[bool] = ...) -> None: ...

class LeftFile(_message.Message):
    __slots__ = ("path", "reason", "nbytes")
    PATH_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    path: str
    reason: str
    nbytes: int
    def __init__(self, path: _Optional[str] = ..., reason: _Optional[str] = ..., nbytes: _Optional[int] = ...) -> None: ...

class RestoreRequest(_message.Message):
    __slots__ = ("job", "rank", "step", "replica_group", "alone", "world_size", "tensors", "skip_answer_checksums")
    JOB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    REPLICA_GROUP_FIELD_NUMBER: _ClassVar[int]
    ALONE_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    SKIP_ANSWER_CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    job: str
    rank: int
    step: int
    replica_group: _containers.RepeatedScalarFieldContainer[int]
    alone: bool
    world_size: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorRequest]
    skip_answer_checksums: bool
    def __init__(self, job: _Optional[str] = ..., rank: _Optional[int] = ..., step: _Optional[int] = ..., replica_group: _Optional[_Iterable[int]] = ..., alone: _Optional[bool] = ..., world_size: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorRequest, _Mapping]]] = ..., skip_answer_checksums: _Optional[bool] = ...) -> None: ...

class TensorRequest(_message.Message):
    __slots__ = ("name", "dtype", "global_shape", "regions")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_SHAPE_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    global_shape: _containers.RepeatedScalarFieldContainer[int]
    regions: _containers.RepeatedCompositeFieldContainer[Region]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., global_shape: _Optional[_Iterable[int]] = ..., regions: _Optional[_Iterable[_Union[Region, _Mapping]]] = ...) -> None: ...

class Region(_message.Message):
    __slots__ = ("index",)
    INDEX_FIELD_NUMBER: _ClassVar[int]
    index: _containers.RepeatedCompositeFieldContainer[Slice]
    def __init__(self, index: _Optional[_Iterable[_Union[Slice, _Mapping]]] = ...) -> None: ...

class RestoreResponse(_message.Message):
    __slots__ = ("step", "segment_path", "slots", "checksums", "tensors", "source", "source_detail", "world_size", "phases", "other_segments")
    STEP_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_PATH_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_DETAIL_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    PHASES_FIELD_NUMBER: _ClassVar[int]
    OTHER_SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    step: int
    segment_path: str
    slots: _containers.RepeatedCompositeFieldContainer[Slot]
    checksums: _containers.RepeatedScalarFieldContainer[int]
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    source: str
    source_detail: str
    world_size: int
    phases: _containers.RepeatedCompositeFieldContainer[Phase]
    other_segments: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, step: _Optional[int] = ..., segment_path: _Optional[str] = ..., slots: _Optional[_Iterable[_Union[Slot, _Mapping]]] = ..., checksums: _Optional[_Iterable[int]] = ..., tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., source: _Optional[str] = ..., source_detail: _Optional[str] = ..., world_size: _Optional[int] = ..., phases: _Optional[_Iterable[_Union[Phase, _Mapping]]] = ..., other_segments: _Optional[_Iterable[str]] = ...) -> None: ...

class RestoreUpdate(_message.Message):
    __slots__ = ("segment", "restored")
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    RESTORED_FIELD_NUMBER: _ClassVar[int]
    segment: AnswerSegment
    restored: RestoreResponse
    def __init__(self, segment: _Optional[_Union[AnswerSegment, _Mapping]] = ..., restored: _Optional[_Union[RestoreResponse, _Mapping]] = ...) -> None: ...

class AnswerSegment(_message.Message):
    __slots__ = ("path", "nbytes")
    PATH_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    path: str
    nbytes: int
    def __init__(self, path: _Optional[str] = ..., nbytes: _Optional[int] = ...) -> None: ...

class Phase(_message.Message):
    __slots__ = ("name", "seconds")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    name: str
    seconds: float
    def __init__(self, name: _Optional[str] = ..., seconds: _Optional[float] = ...) -> None: ...

class WaitCommittedRequest(_message.Message):
    __slots__ = ("job", "step", "timeout_seconds")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    job: str
    step: int
    timeout_seconds: float
    def __init__(self, job: _Optional[str] = ..., step: _Optional[int] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class WaitCommittedResponse(_message.Message):
    __slots__ = ("committed", "latest_committed_step")
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    LATEST_COMMITTED_STEP_FIELD_NUMBER: _ClassVar[int]
    committed: bool
    latest_committed_step: int
    def __init__(self, committed: _Optional[bool] = ..., latest_committed_step: _Optional[int] = ...) -> None: ...

class PersistRequest(_message.Message):
    __slots__ = ("job", "rank", "step", "directory", "record")
    JOB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    RECORD_FIELD_NUMBER: _ClassVar[int]
    job: str
    rank: int
    step: int
    directory: str
    record: str
    def __init__(self, job: _Optional[str] = ..., rank: _Optional[int] = ..., step: _Optional[int] = ..., directory: _Optional[str] = ..., record: _Optional[str] = ...) -> None: ...

class PersistResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FinishSaveRequest(_message.Message):
    __slots__ = ("record", "drop")
    RECORD_FIELD_NUMBER: _ClassVar[int]
    DROP_FIELD_NUMBER: _ClassVar[int]
    record: str
    drop: bool
    def __init__(self, record: _Optional[str] = ..., drop: _Optional[bool] = ...) -> None: ...

class FinishSaveResponse(_message.Message):
    __slots__ = ("state", "detail")
    class State(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        WATCHING: _ClassVar[FinishSaveResponse.State]
        FINALIZED: _ClassVar[FinishSaveResponse.State]
        DROPPED: _ClassVar[FinishSaveResponse.State]
        TRAINER_ALIVE: _ClassVar[FinishSaveResponse.State]
    WATCHING: FinishSaveResponse.State
    FINALIZED: FinishSaveResponse.State
    DROPPED: FinishSaveResponse.State
    TRAINER_ALIVE: FinishSaveResponse.State
    STATE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    state: FinishSaveResponse.State
    detail: str
    def __init__(self, state: _Optional[_Union[FinishSaveResponse.State, str]] = ..., detail: _Optional[str] = ...) -> None: ...

class DropAfterRequest(_message.Message):
    __slots__ = ("job", "step")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    job: str
    step: int
    def __init__(self, job: _Optional[str] = ..., step: _Optional[int] = ...) -> None: ...

class DropAfterResponse(_message.Message):
    __slots__ = ("dropped_copies",)
    DROPPED_COPIES_FIELD_NUMBER: _ClassVar[int]
    dropped_copies: int
    def __init__(self, dropped_copies: _Optional[int] = ...) -> None: ...

class ListSnapshotsRequest(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: str
    def __init__(self, job: _Optional[str] = ...) -> None: ...

class SnapshotSummary(_message.Message):
    __slots__ = ("job", "step", "committed", "local_ranks", "nbytes")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANKS_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    job: str
    step: int
    committed: bool
    local_ranks: _containers.RepeatedScalarFieldContainer[int]
    nbytes: int
    def __init__(self, job: _Optional[str] = ..., step: _Optional[int] = ..., committed: _Optional[bool] = ..., local_ranks: _Optional[_Iterable[int]] = ..., nbytes: _Optional[int] = ...) -> None: ...

class ListSnapshotsResponse(_message.Message):
    __slots__ = ("snapshots",)
    SNAPSHOTS_FIELD_NUMBER: _ClassVar[int]
    snapshots: _containers.RepeatedCompositeFieldContainer[SnapshotSummary]
    def __init__(self, snapshots: _Optional[_Iterable[_Union[SnapshotSummary, _Mapping]]] = ...) -> None: ...

class DeleteSnapshotsRequest(_message.Message):
    __slots__ = ("job", "steps")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    job: str
    steps: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, job: _Optional[str] = ..., steps: _Optional[_Iterable[int]] = ...) -> None: ...

class DeleteSnapshotsResponse(_message.Message):
    __slots__ = ("deleted_steps",)
    DELETED_STEPS_FIELD_NUMBER: _ClassVar[int]
    deleted_steps: int
    def __init__(self, deleted_steps: _Optional[int] = ...) -> None: ...

class LogRecord(_message.Message):
    __slots__ = ("step", "payload")
    STEP_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    step: int
    payload: bytes
    def __init__(self, step: _Optional[int] = ..., payload: _Optional[bytes] = ...) -> None: ...

class AppendLogRequest(_message.Message):
    __slots__ = ("job", "rank", "records", "stream")
    JOB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    job: str
    rank: int
    records: _containers.RepeatedCompositeFieldContainer[LogRecord]
    stream: str
    def __init__(self, job: _Optional[str] = ..., rank: _Optional[int] = ..., records: _Optional[_Iterable[_Union[LogRecord, _Mapping]]] = ..., stream: _Optional[str] = ...) -> None: ...

class AppendLogResponse(_message.Message):
    __slots__ = ("last_step", "copies")
    LAST_STEP_FIELD_NUMBER: _ClassVar[int]
    COPIES_FIELD_NUMBER: _ClassVar[int]
    last_step: int
    copies: int
    def __init__(self, last_step: _Optional[int] = ..., copies: _Optional[int] = ...) -> None: ...

class AppendLogsRequest(_message.Message):
    __slots__ = ("logs",)
    LOGS_FIELD_NUMBER: _ClassVar[int]
    logs: _containers.RepeatedCompositeFieldContainer[AppendLogRequest]
    def __init__(self, logs: _Optional[_Iterable[_Union[AppendLogRequest, _Mapping]]] = ...) -> None: ...

class AppendLogsResponse(_message.Message):
    __slots__ = ("logs",)
    LOGS_FIELD_NUMBER: _ClassVar[int]
    logs: _containers.RepeatedCompositeFieldContainer[AppendLogResponse]
    def __init__(self, logs: _Optional[_Iterable[_Union[AppendLogResponse, _Mapping]]] = ...) -> None: ...

class ReadLogRequest(_message.Message):
    __slots__ = ("job", "rank", "after_step", "stream", "until_step")
    JOB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    AFTER_STEP_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    UNTIL_STEP_FIELD_NUMBER: _ClassVar[int]
    job: str
    rank: int
    after_step: int
    stream: str
    until_step: int
    def __init__(self, job: _Optional[str] = ..., rank: _Optional[int] = ..., after_step: _Optional[int] = ..., stream: _Optional[str] = ..., until_step: _Optional[int] = ...) -> None: ...

class ReadLogResponse(_message.Message):
    __slots__ = ("records", "source")
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    records: _containers.RepeatedCompositeFieldContainer[LogRecord]
    source: str
    def __init__(self, records: _Optional[_Iterable[_Union[LogRecord, _Mapping]]] = ..., source: _Optional[str] = ...) -> None: ...
