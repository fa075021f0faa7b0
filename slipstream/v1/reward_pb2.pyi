from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RewardItem(_message.Message):
    __slots__ = ("item_id", "prompt", "response", "label", "rm_type", "metadata")
    ITEM_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    RM_TYPE_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    item_id: str
    prompt: str
    response: bytes
    label: str
    rm_type: str
    metadata: _struct_pb2.Struct
    def __init__(self, item_id: _Optional[str] = ..., prompt: _Optional[str] = ..., response: _Optional[bytes] = ..., label: _Optional[str] = ..., rm_type: _Optional[str] = ..., metadata: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class RewardResult(_message.Message):
    __slots__ = ("item_id", "reward", "details", "error", "error_message", "text_details", "rm_type", "error_kind", "error_traceback")
    class DetailsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class TextDetailsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ITEM_ID_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TEXT_DETAILS_FIELD_NUMBER: _ClassVar[int]
    RM_TYPE_FIELD_NUMBER: _ClassVar[int]
    ERROR_KIND_FIELD_NUMBER: _ClassVar[int]
    ERROR_TRACEBACK_FIELD_NUMBER: _ClassVar[int]
    item_id: str
    reward: float
    details: _containers.ScalarMap[str, float]
    error: bool
    error_message: str
    text_details: _containers.ScalarMap[str, str]
    rm_type: str
    error_kind: str
    error_traceback: str
    def __init__(self, item_id: _Optional[str] = ..., reward: _Optional[float] = ..., details: _Optional[_Mapping[str, float]] = ..., error: _Optional[bool] = ..., error_message: _Optional[str] = ..., text_details: _Optional[_Mapping[str, str]] = ..., rm_type: _Optional[str] = ..., error_kind: _Optional[str] = ..., error_traceback: _Optional[str] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("items", "rm_type", "timeout_seconds")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    RM_TYPE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[RewardItem]
    rm_type: str
    timeout_seconds: float
    def __init__(self, items: _Optional[_Iterable[_Union[RewardItem, _Mapping]]] = ..., rm_type: _Optional[str] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class ScoreGroupRequest(_message.Message):
    __slots__ = ("items", "rm_type", "timeout_seconds")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    RM_TYPE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[RewardItem]
    rm_type: str
    timeout_seconds: float
    def __init__(self, items: _Optional[_Iterable[_Union[RewardItem, _Mapping]]] = ..., rm_type: _Optional[str] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[RewardResult]
    def __init__(self, results: _Optional[_Iterable[_Union[RewardResult, _Mapping]]] = ...) -> None: ...

class ListRewardFunctionsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RewardFunctionInfo(_message.Message):
    __slots__ = ("name", "group", "description")
    NAME_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    name: str
    group: bool
    description: str
    def __init__(self, name: _Optional[str] = ..., group: _Optional[bool] = ..., description: _Optional[str] = ...) -> None: ...

class ListRewardFunctionsResponse(_message.Message):
    __slots__ = ("functions",)
    FUNCTIONS_FIELD_NUMBER: _ClassVar[int]
    functions: _containers.RepeatedCompositeFieldContainer[RewardFunctionInfo]
    def __init__(self, functions: _Optional[_Iterable[_Union[RewardFunctionInfo, _Mapping]]] = ...) -> None: ...
