from slipstream.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EngineState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ENGINE_STATE_UNSPECIFIED: _ClassVar[EngineState]
    ENGINE_STATE_STARTING: _ClassVar[EngineState]
    ENGINE_STATE_HEALTHY: _ClassVar[EngineState]
    ENGINE_STATE_EVICTED: _ClassVar[EngineState]
    ENGINE_STATE_DRAINING: _ClassVar[EngineState]

class WeightTransport(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WEIGHT_TRANSPORT_UNSPECIFIED: _ClassVar[WeightTransport]
    WEIGHT_TRANSPORT_BROADCAST: _ClassVar[WeightTransport]
    WEIGHT_TRANSPORT_STREAMED: _ClassVar[WeightTransport]
    WEIGHT_TRANSPORT_HANDLES: _ClassVar[WeightTransport]
    WEIGHT_TRANSPORT_DISK: _ClassVar[WeightTransport]
    WEIGHT_TRANSPORT_LORA: _ClassVar[WeightTransport]
ENGINE_STATE_UNSPECIFIED: EngineState
ENGINE_STATE_STARTING: EngineState
ENGINE_STATE_HEALTHY: EngineState
ENGINE_STATE_EVICTED: EngineState
ENGINE_STATE_DRAINING: EngineState
WEIGHT_TRANSPORT_UNSPECIFIED: WeightTransport
WEIGHT_TRANSPORT_BROADCAST: WeightTransport
WEIGHT_TRANSPORT_STREAMED: WeightTransport
WEIGHT_TRANSPORT_HANDLES: WeightTransport
WEIGHT_TRANSPORT_DISK: WeightTransport
WEIGHT_TRANSPORT_LORA: WeightTransport

class EngineInfo(_message.Message):
    __slots__ = ("url", "tp_size", "state", "weight_version", "num_outstanding_requests", "model_path", "last_error")
    URL_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTSTANDING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    url: str
    tp_size: int
    state: EngineState
    weight_version: str
    num_outstanding_requests: int
    model_path: str
    last_error: str
    def __init__(self, url: _Optional[str] = ..., tp_size: _Optional[int] = ..., state: _Optional[_Union[EngineState, str]] = ..., weight_version: _Optional[str] = ..., num_outstanding_requests: _Optional[int] = ..., model_path: _Optional[str] = ..., last_error: _Optional[str] = ...) -> None: ...

class RegisterEngineRequest(_message.Message):
    __slots__ = ("url",)
    URL_FIELD_NUMBER: _ClassVar[int]
    url: str
    def __init__(self, url: _Optional[str] = ...) -> None: ...

class DeregisterEngineRequest(_message.Message):
    __slots__ = ("url",)
    URL_FIELD_NUMBER: _ClassVar[int]
    url: str
    def __init__(self, url: _Optional[str] = ...) -> None: ...

class DeregisterEngineResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListEnginesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListEnginesResponse(_message.Message):
    __slots__ = ("engines",)
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    engines: _containers.RepeatedCompositeFieldContainer[EngineInfo]
    def __init__(self, engines: _Optional[_Iterable[_Union[EngineInfo, _Mapping]]] = ...) -> None: ...

class StartRolloutRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StartRolloutResponse(_message.Message):
    __slots__ = ("started",)
    STARTED_FIELD_NUMBER: _ClassVar[int]
    started: bool
    def __init__(self, started: _Optional[bool] = ...) -> None: ...

class StopRolloutRequest(_message.Message):
    __slots__ = ("abort_in_flight",)
    ABORT_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    abort_in_flight: bool
    def __init__(self, abort_in_flight: _Optional[bool] = ...) -> None: ...

class StopRolloutResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EvaluateRequest(_message.Message):
    __slots__ = ("datasets", "n_samples_per_prompt", "sampling_params", "step")
    DATASETS_FIELD_NUMBER: _ClassVar[int]
    N_SAMPLES_PER_PROMPT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    datasets: _containers.RepeatedScalarFieldContainer[str]
    n_samples_per_prompt: int
    sampling_params: _common_pb2.SamplingParams
    step: int
    def __init__(self, datasets: _Optional[_Iterable[str]] = ..., n_samples_per_prompt: _Optional[int] = ..., sampling_params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., step: _Optional[int] = ...) -> None: ...

class EvalResult(_message.Message):
    __slots__ = ("dataset", "num_samples", "mean_reward", "metrics")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    DATASET_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    MEAN_REWARD_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    num_samples: int
    mean_reward: float
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, dataset: _Optional[str] = ..., num_samples: _Optional[int] = ..., mean_reward: _Optional[float] = ..., metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class EvaluateResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[EvalResult]
    def __init__(self, results: _Optional[_Iterable[_Union[EvalResult, _Mapping]]] = ...) -> None: ...

class EngineRank(_message.Message):
    __slots__ = ("url", "rank_offset", "tp_size")
    URL_FIELD_NUMBER: _ClassVar[int]
    RANK_OFFSET_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    url: str
    rank_offset: int
    tp_size: int
    def __init__(self, url: _Optional[str] = ..., rank_offset: _Optional[int] = ..., tp_size: _Optional[int] = ...) -> None: ...

class PrepareWeightSyncRequest(_message.Message):
    __slots__ = ("version", "master_address", "master_port", "group_name", "backend", "sources", "delta", "delta_base_version", "transport", "plan")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MASTER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MASTER_PORT_FIELD_NUMBER: _ClassVar[int]
    GROUP_NAME_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    DELTA_BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    version: int
    master_address: str
    master_port: int
    group_name: str
    backend: str
    sources: _containers.RepeatedCompositeFieldContainer[WeightSource]
    delta: bool
    delta_base_version: int
    transport: WeightTransport
    plan: _containers.RepeatedCompositeFieldContainer[BucketSpecs]
    def __init__(self, version: _Optional[int] = ..., master_address: _Optional[str] = ..., master_port: _Optional[int] = ..., group_name: _Optional[str] = ..., backend: _Optional[str] = ..., sources: _Optional[_Iterable[_Union[WeightSource, _Mapping]]] = ..., delta: _Optional[bool] = ..., delta_base_version: _Optional[int] = ..., transport: _Optional[_Union[WeightTransport, str]] = ..., plan: _Optional[_Iterable[_Union[BucketSpecs, _Mapping]]] = ...) -> None: ...

class WeightSource(_message.Message):
    __slots__ = ("master_address", "master_port", "group_name")
    MASTER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MASTER_PORT_FIELD_NUMBER: _ClassVar[int]
    GROUP_NAME_FIELD_NUMBER: _ClassVar[int]
    master_address: str
    master_port: int
    group_name: str
    def __init__(self, master_address: _Optional[str] = ..., master_port: _Optional[int] = ..., group_name: _Optional[str] = ...) -> None: ...

class PrepareWeightSyncResponse(_message.Message):
    __slots__ = ("world_size", "engines", "group_created", "delta_base_version", "transport", "plan_taken")
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    GROUP_CREATED_FIELD_NUMBER: _ClassVar[int]
    DELTA_BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    PLAN_TAKEN_FIELD_NUMBER: _ClassVar[int]
    world_size: int
    engines: _containers.RepeatedCompositeFieldContainer[EngineRank]
    group_created: bool
    delta_base_version: int
    transport: WeightTransport
    plan_taken: bool
    def __init__(self, world_size: _Optional[int] = ..., engines: _Optional[_Iterable[_Union[EngineRank, _Mapping]]] = ..., group_created: _Optional[bool] = ..., delta_base_version: _Optional[int] = ..., transport: _Optional[_Union[WeightTransport, str]] = ..., plan_taken: _Optional[bool] = ...) -> None: ...

class WeightBucket(_message.Message):
    __slots__ = ("version", "bucket_index", "tensors", "load_format", "serialized_named_tensors", "group_name", "num_buckets", "plan", "commit", "planned")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BUCKET_INDEX_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FORMAT_FIELD_NUMBER: _ClassVar[int]
    SERIALIZED_NAMED_TENSORS_FIELD_NUMBER: _ClassVar[int]
    GROUP_NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_BUCKETS_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    PLANNED_FIELD_NUMBER: _ClassVar[int]
    version: int
    bucket_index: int
    tensors: _containers.RepeatedCompositeFieldContainer[_common_pb2.TensorSpec]
    load_format: str
    serialized_named_tensors: _containers.RepeatedScalarFieldContainer[bytes]
    group_name: str
    num_buckets: int
    plan: _containers.RepeatedCompositeFieldContainer[BucketSpecs]
    commit: bool
    planned: bool
    def __init__(self, version: _Optional[int] = ..., bucket_index: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[_common_pb2.TensorSpec, _Mapping]]] = ..., load_format: _Optional[str] = ..., serialized_named_tensors: _Optional[_Iterable[bytes]] = ..., group_name: _Optional[str] = ..., num_buckets: _Optional[int] = ..., plan: _Optional[_Iterable[_Union[BucketSpecs, _Mapping]]] = ..., commit: _Optional[bool] = ..., planned: _Optional[bool] = ...) -> None: ...

class BucketSpecs(_message.Message):
    __slots__ = ("tensors",)
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[_common_pb2.TensorSpec]
    def __init__(self, tensors: _Optional[_Iterable[_Union[_common_pb2.TensorSpec, _Mapping]]] = ...) -> None: ...

class EngineResult(_message.Message):
    __slots__ = ("url", "success", "message")
    URL_FIELD_NUMBER: _ClassVar[int]
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    url: str
    success: bool
    message: str
    def __init__(self, url: _Optional[str] = ..., success: _Optional[bool] = ..., message: _Optional[str] = ...) -> None: ...

class WeightBucketResult(_message.Message):
    __slots__ = ("bucket_index", "engines", "committed")
    BUCKET_INDEX_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    bucket_index: int
    engines: _containers.RepeatedCompositeFieldContainer[EngineResult]
    committed: bool
    def __init__(self, bucket_index: _Optional[int] = ..., engines: _Optional[_Iterable[_Union[EngineResult, _Mapping]]] = ..., committed: _Optional[bool] = ...) -> None: ...

class CommitWeightSyncRequest(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class CommitWeightSyncResponse(_message.Message):
    __slots__ = ("engines",)
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    engines: _containers.RepeatedCompositeFieldContainer[EngineResult]
    def __init__(self, engines: _Optional[_Iterable[_Union[EngineResult, _Mapping]]] = ...) -> None: ...

class AbortWeightSyncRequest(_message.Message):
    __slots__ = ("version", "reason")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    version: int
    reason: str
    def __init__(self, version: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class AbortWeightSyncResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReleaseEngineMemoryRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReleaseEngineMemoryResponse(_message.Message):
    __slots__ = ("engines",)
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    engines: _containers.RepeatedCompositeFieldContainer[EngineResult]
    def __init__(self, engines: _Optional[_Iterable[_Union[EngineResult, _Mapping]]] = ...) -> None: ...
