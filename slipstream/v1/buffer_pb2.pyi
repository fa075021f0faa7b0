import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from slipstream.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LeaseBlock(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LEASE_BLOCK_UNSPECIFIED: _ClassVar[LeaseBlock]
    LEASE_BLOCK_BACKPRESSURE: _ClassVar[LeaseBlock]
    LEASE_BLOCK_STALENESS: _ClassVar[LeaseBlock]
    LEASE_BLOCK_EXHAUSTED: _ClassVar[LeaseBlock]
LEASE_BLOCK_UNSPECIFIED: LeaseBlock
LEASE_BLOCK_BACKPRESSURE: LeaseBlock
LEASE_BLOCK_STALENESS: LeaseBlock
LEASE_BLOCK_EXHAUSTED: LeaseBlock

class Lease(_message.Message):
    __slots__ = ("lease_id", "group", "deadline", "upload_key", "submit_namespace")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_KEY_FIELD_NUMBER: _ClassVar[int]
    SUBMIT_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    group: _common_pb2.PromptGroup
    deadline: _timestamp_pb2.Timestamp
    upload_key: str
    submit_namespace: str
    def __init__(self, lease_id: _Optional[str] = ..., group: _Optional[_Union[_common_pb2.PromptGroup, _Mapping]] = ..., deadline: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., upload_key: _Optional[str] = ..., submit_namespace: _Optional[str] = ...) -> None: ...

class LeasePromptsRequest(_message.Message):
    __slots__ = ("worker_id", "max_groups", "lease_seconds", "dataset")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_GROUPS_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DATASET_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    max_groups: int
    lease_seconds: float
    dataset: str
    def __init__(self, worker_id: _Optional[str] = ..., max_groups: _Optional[int] = ..., lease_seconds: _Optional[float] = ..., dataset: _Optional[str] = ...) -> None: ...

class LeasePromptsResponse(_message.Message):
    __slots__ = ("leases", "policy_version", "blocked")
    LEASES_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    BLOCKED_FIELD_NUMBER: _ClassVar[int]
    leases: _containers.RepeatedCompositeFieldContainer[Lease]
    policy_version: int
    blocked: LeaseBlock
    def __init__(self, leases: _Optional[_Iterable[_Union[Lease, _Mapping]]] = ..., policy_version: _Optional[int] = ..., blocked: _Optional[_Union[LeaseBlock, str]] = ...) -> None: ...

class ExtendLeaseRequest(_message.Message):
    __slots__ = ("lease_ids", "lease_seconds")
    LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    lease_ids: _containers.RepeatedScalarFieldContainer[str]
    lease_seconds: float
    def __init__(self, lease_ids: _Optional[_Iterable[str]] = ..., lease_seconds: _Optional[float] = ...) -> None: ...

class ExtendLeaseResponse(_message.Message):
    __slots__ = ("leases", "expired")
    LEASES_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_FIELD_NUMBER: _ClassVar[int]
    leases: _containers.RepeatedCompositeFieldContainer[Lease]
    expired: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, leases: _Optional[_Iterable[_Union[Lease, _Mapping]]] = ..., expired: _Optional[_Iterable[str]] = ...) -> None: ...

class ReleaseLeaseRequest(_message.Message):
    __slots__ = ("lease_id", "partial_samples", "reason")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    partial_samples: _containers.RepeatedCompositeFieldContainer[_common_pb2.Sample]
    reason: str
    def __init__(self, lease_id: _Optional[str] = ..., partial_samples: _Optional[_Iterable[_Union[_common_pb2.Sample, _Mapping]]] = ..., reason: _Optional[str] = ...) -> None: ...

class ReleaseLeaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SubmitGroupRequest(_message.Message):
    __slots__ = ("lease_id", "group", "arrays_in_redis")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    ARRAYS_IN_REDIS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    group: _common_pb2.PromptGroup
    arrays_in_redis: bool
    def __init__(self, lease_id: _Optional[str] = ..., group: _Optional[_Union[_common_pb2.PromptGroup, _Mapping]] = ..., arrays_in_redis: _Optional[bool] = ...) -> None: ...

class SubmitGroupResponse(_message.Message):
    __slots__ = ("accepted", "duplicate", "filtered_reason")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    FILTERED_REASON_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    duplicate: bool
    filtered_reason: str
    def __init__(self, accepted: _Optional[bool] = ..., duplicate: _Optional[bool] = ..., filtered_reason: _Optional[str] = ...) -> None: ...

class GetBatchRequest(_message.Message):
    __slots__ = ("step", "dp_rank", "dp_size", "timeout_seconds", "arrays_from_redis")
    STEP_FIELD_NUMBER: _ClassVar[int]
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    DP_SIZE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ARRAYS_FROM_REDIS_FIELD_NUMBER: _ClassVar[int]
    step: int
    dp_rank: int
    dp_size: int
    timeout_seconds: float
    arrays_from_redis: bool
    def __init__(self, step: _Optional[int] = ..., dp_rank: _Optional[int] = ..., dp_size: _Optional[int] = ..., timeout_seconds: _Optional[float] = ..., arrays_from_redis: _Optional[bool] = ...) -> None: ...

class GetBatchResponse(_message.Message):
    __slots__ = ("step", "groups", "num_tokens", "total_groups", "policy_version", "arrays", "arrays_keys")
    STEP_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_GROUPS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    ARRAYS_FIELD_NUMBER: _ClassVar[int]
    ARRAYS_KEYS_FIELD_NUMBER: _ClassVar[int]
    step: int
    groups: _containers.RepeatedCompositeFieldContainer[_common_pb2.PromptGroup]
    num_tokens: int
    total_groups: int
    policy_version: int
    arrays: _containers.RepeatedScalarFieldContainer[bytes]
    arrays_keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, step: _Optional[int] = ..., groups: _Optional[_Iterable[_Union[_common_pb2.PromptGroup, _Mapping]]] = ..., num_tokens: _Optional[int] = ..., total_groups: _Optional[int] = ..., policy_version: _Optional[int] = ..., arrays: _Optional[_Iterable[bytes]] = ..., arrays_keys: _Optional[_Iterable[str]] = ...) -> None: ...

class CommitBatchRequest(_message.Message):
    __slots__ = ("step",)
    STEP_FIELD_NUMBER: _ClassVar[int]
    step: int
    def __init__(self, step: _Optional[int] = ...) -> None: ...

class CommitBatchResponse(_message.Message):
    __slots__ = ("num_deleted_groups",)
    NUM_DELETED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    num_deleted_groups: int
    def __init__(self, num_deleted_groups: _Optional[int] = ...) -> None: ...

class SetPolicyVersionRequest(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class SetPolicyVersionResponse(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class RewindRequest(_message.Message):
    __slots__ = ("step", "policy_version")
    STEP_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    step: int
    policy_version: int
    def __init__(self, step: _Optional[int] = ..., policy_version: _Optional[int] = ...) -> None: ...

class RewindResponse(_message.Message):
    __slots__ = ("num_returned_groups",)
    NUM_RETURNED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    num_returned_groups: int
    def __init__(self, num_returned_groups: _Optional[int] = ...) -> None: ...

class GetStateRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BufferState(_message.Message):
    __slots__ = ("policy_version", "num_pending_prompts", "num_leased_groups", "num_completed_groups", "num_filtered_groups", "epoch", "num_consumed_prompts", "last_committed_step", "counters", "eval_datasets")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_PENDING_PROMPTS_FIELD_NUMBER: _ClassVar[int]
    NUM_LEASED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPLETED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    NUM_FILTERED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NUM_CONSUMED_PROMPTS_FIELD_NUMBER: _ClassVar[int]
    LAST_COMMITTED_STEP_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    EVAL_DATASETS_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    num_pending_prompts: int
    num_leased_groups: int
    num_completed_groups: int
    num_filtered_groups: int
    epoch: int
    num_consumed_prompts: int
    last_committed_step: int
    counters: _containers.ScalarMap[str, int]
    eval_datasets: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, policy_version: _Optional[int] = ..., num_pending_prompts: _Optional[int] = ..., num_leased_groups: _Optional[int] = ..., num_completed_groups: _Optional[int] = ..., num_filtered_groups: _Optional[int] = ..., epoch: _Optional[int] = ..., num_consumed_prompts: _Optional[int] = ..., last_committed_step: _Optional[int] = ..., counters: _Optional[_Mapping[str, int]] = ..., eval_datasets: _Optional[_Iterable[str]] = ...) -> None: ...
