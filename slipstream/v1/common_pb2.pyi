from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SampleStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SAMPLE_STATUS_UNSPECIFIED: _ClassVar[SampleStatus]
    SAMPLE_STATUS_PENDING: _ClassVar[SampleStatus]
    SAMPLE_STATUS_COMPLETED: _ClassVar[SampleStatus]
    SAMPLE_STATUS_TRUNCATED: _ClassVar[SampleStatus]
    SAMPLE_STATUS_ABORTED: _ClassVar[SampleStatus]
    SAMPLE_STATUS_FAILED: _ClassVar[SampleStatus]
SAMPLE_STATUS_UNSPECIFIED: SampleStatus
SAMPLE_STATUS_PENDING: SampleStatus
SAMPLE_STATUS_COMPLETED: SampleStatus
SAMPLE_STATUS_TRUNCATED: SampleStatus
SAMPLE_STATUS_ABORTED: SampleStatus
SAMPLE_STATUS_FAILED: SampleStatus

class WeightVersionSpan(_message.Message):
    __slots__ = ("version", "start", "end")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    version: str
    start: int
    end: int
    def __init__(self, version: _Optional[str] = ..., start: _Optional[int] = ..., end: _Optional[int] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "max_new_tokens", "min_new_tokens", "stop", "stop_token_ids", "ignore_eos", "skip_special_tokens", "no_stop_trim", "sampling_seed", "repetition_penalty", "frequency_penalty", "presence_penalty")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NO_STOP_TRIM_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_SEED_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    max_new_tokens: int
    min_new_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    skip_special_tokens: bool
    no_stop_trim: bool
    sampling_seed: int
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., max_new_tokens: _Optional[int] = ..., min_new_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., skip_special_tokens: _Optional[bool] = ..., no_stop_trim: _Optional[bool] = ..., sampling_seed: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ...) -> None: ...

class Sample(_message.Message):
    __slots__ = ("sample_id", "index", "tokens", "prompt_length", "response_length", "response_text", "loss_mask", "rollout_logprobs", "reward", "reward_details", "status", "status_message", "weight_versions", "metadata", "engine_url", "num_turns", "routed_experts", "teacher_logprobs", "reward_error")
    class RewardDetailsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    SAMPLE_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_TEXT_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    REWARD_DETAILS_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    STATUS_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    ENGINE_URL_FIELD_NUMBER: _ClassVar[int]
    NUM_TURNS_FIELD_NUMBER: _ClassVar[int]
    ROUTED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    TEACHER_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    REWARD_ERROR_FIELD_NUMBER: _ClassVar[int]
    sample_id: str
    index: int
    tokens: bytes
    prompt_length: int
    response_length: int
    response_text: str
    loss_mask: bytes
    rollout_logprobs: bytes
    reward: float
    reward_details: _containers.ScalarMap[str, float]
    status: SampleStatus
    status_message: str
    weight_versions: _containers.RepeatedCompositeFieldContainer[WeightVersionSpan]
    metadata: _struct_pb2.Struct
    engine_url: str
    num_turns: int
    routed_experts: bytes
    teacher_logprobs: bytes
    reward_error: RewardError
    def __init__(self, sample_id: _Optional[str] = ..., index: _Optional[int] = ..., tokens: _Optional[bytes] = ..., prompt_length: _Optional[int] = ..., response_length: _Optional[int] = ..., response_text: _Optional[str] = ..., loss_mask: _Optional[bytes] = ..., rollout_logprobs: _Optional[bytes] = ..., reward: _Optional[float] = ..., reward_details: _Optional[_Mapping[str, float]] = ..., status: _Optional[_Union[SampleStatus, str]] = ..., status_message: _Optional[str] = ..., weight_versions: _Optional[_Iterable[_Union[WeightVersionSpan, _Mapping]]] = ..., metadata: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., engine_url: _Optional[str] = ..., num_turns: _Optional[int] = ..., routed_experts: _Optional[bytes] = ..., teacher_logprobs: _Optional[bytes] = ..., reward_error: _Optional[_Union[RewardError, _Mapping]] = ...) -> None: ...

class RewardError(_message.Message):
    __slots__ = ("rm_type", "kind", "message", "traceback")
    RM_TYPE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TRACEBACK_FIELD_NUMBER: _ClassVar[int]
    rm_type: str
    kind: str
    message: str
    traceback: str
    def __init__(self, rm_type: _Optional[str] = ..., kind: _Optional[str] = ..., message: _Optional[str] = ..., traceback: _Optional[str] = ...) -> None: ...

class PromptGroup(_message.Message):
    __slots__ = ("group_id", "dataset", "prompt_index", "epoch", "prompt_tokens", "prompt_text", "label", "metadata", "tools_json", "n_samples", "samples", "min_weight_version", "timings")
    class TimingsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    DATASET_FIELD_NUMBER: _ClassVar[int]
    PROMPT_INDEX_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    N_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    MIN_WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    dataset: str
    prompt_index: int
    epoch: int
    prompt_tokens: bytes
    prompt_text: str
    label: str
    metadata: _struct_pb2.Struct
    tools_json: str
    n_samples: int
    samples: _containers.RepeatedCompositeFieldContainer[Sample]
    min_weight_version: int
    timings: _containers.ScalarMap[str, float]
    def __init__(self, group_id: _Optional[str] = ..., dataset: _Optional[str] = ..., prompt_index: _Optional[int] = ..., epoch: _Optional[int] = ..., prompt_tokens: _Optional[bytes] = ..., prompt_text: _Optional[str] = ..., label: _Optional[str] = ..., metadata: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., tools_json: _Optional[str] = ..., n_samples: _Optional[int] = ..., samples: _Optional[_Iterable[_Union[Sample, _Mapping]]] = ..., min_weight_version: _Optional[int] = ..., timings: _Optional[_Mapping[str, float]] = ...) -> None: ...

class Tensor(_message.Message):
    __slots__ = ("data", "shape", "dtype")
    DATA_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    def __init__(self, data: _Optional[bytes] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ...) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...
