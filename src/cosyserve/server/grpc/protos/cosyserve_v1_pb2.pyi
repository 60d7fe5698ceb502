import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Mode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODE_UNSPECIFIED: _ClassVar[Mode]
    MODE_ZERO_SHOT: _ClassVar[Mode]
    MODE_CROSS_LINGUAL: _ClassVar[Mode]
    MODE_INSTRUCT2: _ClassVar[Mode]
    MODE_SFT: _ClassVar[Mode]
    MODE_VC: _ClassVar[Mode]

class VoiceKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    VOICE_KIND_UNSPECIFIED: _ClassVar[VoiceKind]
    VOICE_KIND_REGISTERED: _ClassVar[VoiceKind]
    VOICE_KIND_BUILTIN: _ClassVar[VoiceKind]
MODE_UNSPECIFIED: Mode
MODE_ZERO_SHOT: Mode
MODE_CROSS_LINGUAL: Mode
MODE_INSTRUCT2: Mode
MODE_SFT: Mode
MODE_VC: Mode
VOICE_KIND_UNSPECIFIED: VoiceKind
VOICE_KIND_REGISTERED: VoiceKind
VOICE_KIND_BUILTIN: VoiceKind

class SynthesizeRequest(_message.Message):
    __slots__ = ("text", "voice", "prompt_audio", "prompt_text", "instruct", "source_audio", "mode", "format", "sample_rate", "stream", "seed", "speed", "min_tokens", "max_tokens", "first_hop")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    VOICE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_AUDIO_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    INSTRUCT_FIELD_NUMBER: _ClassVar[int]
    SOURCE_AUDIO_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    SPEED_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_HOP_FIELD_NUMBER: _ClassVar[int]
    text: str
    voice: str
    prompt_audio: bytes
    prompt_text: str
    instruct: str
    source_audio: bytes
    mode: Mode
    format: str
    sample_rate: int
    stream: bool
    seed: int
    speed: float
    min_tokens: int
    max_tokens: int
    first_hop: int
    def __init__(self, text: _Optional[str] = ..., voice: _Optional[str] = ..., prompt_audio: _Optional[bytes] = ..., prompt_text: _Optional[str] = ..., instruct: _Optional[str] = ..., source_audio: _Optional[bytes] = ..., mode: _Optional[_Union[Mode, str]] = ..., format: _Optional[str] = ..., sample_rate: _Optional[int] = ..., stream: _Optional[bool] = ..., seed: _Optional[int] = ..., speed: _Optional[float] = ..., min_tokens: _Optional[int] = ..., max_tokens: _Optional[int] = ..., first_hop: _Optional[int] = ...) -> None: ...

class SynthesizeResponse(_message.Message):
    __slots__ = ("audio", "content_type", "sample_rate")
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    CONTENT_TYPE_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_FIELD_NUMBER: _ClassVar[int]
    audio: bytes
    content_type: str
    sample_rate: int
    def __init__(self, audio: _Optional[bytes] = ..., content_type: _Optional[str] = ..., sample_rate: _Optional[int] = ...) -> None: ...

class ListVoicesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListVoicesResponse(_message.Message):
    __slots__ = ("voices",)
    VOICES_FIELD_NUMBER: _ClassVar[int]
    voices: _containers.RepeatedCompositeFieldContainer[Voice]
    def __init__(self, voices: _Optional[_Iterable[_Union[Voice, _Mapping]]] = ...) -> None: ...

class Voice(_message.Message):
    __slots__ = ("name", "kind", "prompt_text", "audio_sha256", "created_at")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    AUDIO_SHA256_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: VoiceKind
    prompt_text: str
    audio_sha256: str
    created_at: _timestamp_pb2.Timestamp
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[_Union[VoiceKind, str]] = ..., prompt_text: _Optional[str] = ..., audio_sha256: _Optional[str] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class AddVoiceRequest(_message.Message):
    __slots__ = ("name", "audio", "prompt_text")
    NAME_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    name: str
    audio: bytes
    prompt_text: str
    def __init__(self, name: _Optional[str] = ..., audio: _Optional[bytes] = ..., prompt_text: _Optional[str] = ...) -> None: ...

class DeleteVoiceRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class DeleteVoiceResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
