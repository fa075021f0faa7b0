from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TrainerStatus(_message.Message):
    __slots__ = ("step", "policy_version", "phase", "world_size", "last_metrics")
    class LastMetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    STEP_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    LAST_METRICS_FIELD_NUMBER: _ClassVar[int]
    step: int
    policy_version: int
    phase: str
    world_size: int
    last_metrics: _containers.ScalarMap[str, float]
    def __init__(self, step: _Optional[int] = ..., policy_version: _Optional[int] = ..., phase: _Optional[str] = ..., world_size: _Optional[int] = ..., last_metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class SaveCheckpointRequest(_message.Message):
    __slots__ = ("path", "hf")
    PATH_FIELD_NUMBER: _ClassVar[int]
    HF_FIELD_NUMBER: _ClassVar[int]
    path: str
    hf: bool
    def __init__(self, path: _Optional[str] = ..., hf: _Optional[bool] = ...) -> None: ...

class SaveCheckpointResponse(_message.Message):
    __slots__ = ("path", "step")
    PATH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    path: str
    step: int
    def __init__(self, path: _Optional[str] = ..., step: _Optional[int] = ...) -> None: ...

class StopRequest(_message.Message):
    __slots__ = ("save",)
    SAVE_FIELD_NUMBER: _ClassVar[int]
    save: bool
    def __init__(self, save: _Optional[bool] = ...) -> None: ...

class StopResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
