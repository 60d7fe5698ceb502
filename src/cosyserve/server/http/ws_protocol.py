"""The messages of the speech WebSocket (``/v1/audio/speech/ws``).

Every message is one JSON text frame with a ``type``.

Client -> server::

    {"type": "config", "voice": "alice", "format": "pcm", "sample_rate": 24000,
     "seed": 7, "instructions": "speak cheerfully"}          first, exactly once
    {"type": "text", "text": "Hello wor"}                      pieces, as an LLM makes them
    {"type": "flush"}                                          speak what is buffered now
    {"type": "end"}                                            no more text; finish and close
    {"type": "cancel"}                                         stop speaking, drop buffered text

Server -> client::

    {"type": "ready", "format": "pcm", "sample_rate": 24000}  config accepted
    {"type": "started", "segment": 0, "text": "Hello world."} a sentence begins
    {"type": "chunk", "segment": 0, "audio": "<base64>"}       audio bytes, in order
    {"type": "segment_done", "segment": 0}                     that sentence is complete
    {"type": "cancelled"}                                      after a cancel
    {"type": "error", "code": "unknown_voice", "message": "...", "segment": 3}
    {"type": "done"}                                           after end; then the server closes

Audio travels base64-encoded in ``chunk`` events rather than in binary frames, so that
each piece of audio names its sentence and the whole stream is one ordered sequence of
JSON events that any WebSocket client (browsers, agent frameworks) can read. The chunks
of a session concatenate to one audio stream in the configured format (one WAV header,
one Ogg stream...), across sentences; the encoder's last bytes, after ``end``, come in a
chunk with ``"segment": null``.

Config: ``voice`` (a registered voice or built-in speaker) is required; ``format``
(pcm, wav, mp3, opus, aac, flac; default pcm) and ``sample_rate`` (default 24000) as in
``/v1/audio/speech``; ``seed`` makes every sentence reproducible; ``instructions``
(instruct2 mode) needs a voice made from prompt audio. A bad config is answered with an
``error`` event and the connection is closed (code 1008); so is a first message that is
not a config, or none within 30 s.

Errors after that are ``error`` events and the session goes on: a malformed message
(``invalid_message``), a sentence that fails (with its ``segment``; its ``segment_done``
follows), too much text waiting to be spoken (``too_much_text``), server overload
(``overloaded``). ``cancel`` answers ``cancelled``; afterwards no audio of earlier
sentences is sent. After ``end`` only ``cancel`` is accepted. A disconnect aborts all
synthesis of the session.
"""

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, TypeAdapter, ValidationError

from cosyserve.errors import InvalidRequestError

# One text message; an LLM sends a few tokens at a time, so this is generous.
MAX_TEXT_PIECE_CHARS = 4096


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ConfigMessage(_Message):
    """Opens a session: the voice and output format of everything that follows."""

    type: Literal["config"]
    voice: Annotated[str, StringConstraints(min_length=1, max_length=64)]
    # Checked by the audio encoder, whose errors name the supported formats and rates.
    format: Annotated[str, StringConstraints(max_length=16)] = "pcm"
    sample_rate: int | None = None
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    instructions: Annotated[str, StringConstraints(max_length=1000)] = ""


class TextMessage(_Message):
    type: Literal["text"]
    text: Annotated[str, StringConstraints(max_length=MAX_TEXT_PIECE_CHARS)]


class FlushMessage(_Message):
    type: Literal["flush"]


class EndMessage(_Message):
    type: Literal["end"]


class CancelMessage(_Message):
    type: Literal["cancel"]


ClientMessage = Annotated[
    ConfigMessage | TextMessage | FlushMessage | EndMessage | CancelMessage,
    Field(discriminator="type"),
]
_CLIENT_MESSAGE: TypeAdapter[ClientMessage] = TypeAdapter(ClientMessage)
_TYPES = "config, text, flush, end, cancel"


class InvalidMessageError(InvalidRequestError):
    code = "invalid_message"


def parse_client_message(raw: str | bytes) -> ClientMessage:
    """Parse one client frame; raises :class:`InvalidMessageError` with a stable message
    (it names the offending field, never echoes the input)."""
    try:
        return _CLIENT_MESSAGE.validate_json(raw)
    except ValidationError as exc:
        raise InvalidMessageError(_describe(exc)) from None


def _describe(exc: ValidationError) -> str:
    error = exc.errors(include_input=False, include_url=False)[0]
    if error["type"] == "json_invalid":
        return "malformed JSON message"
    # The first location item is the message type (the union's tag); none: no valid type.
    field = ".".join(str(part) for part in error["loc"][1:])
    if not field:
        return f"a message must be a JSON object whose type is one of: {_TYPES}"
    return f"invalid {field}: {error['msg']}"


class ReadyEvent(_Message):
    type: Literal["ready"] = "ready"
    format: str
    sample_rate: int


class StartedEvent(_Message):
    type: Literal["started"] = "started"
    segment: int
    text: str


class ChunkEvent(_Message):
    type: Literal["chunk"] = "chunk"
    segment: int | None
    audio: str  # base64


class SegmentDoneEvent(_Message):
    type: Literal["segment_done"] = "segment_done"
    segment: int


class CancelledEvent(_Message):
    type: Literal["cancelled"] = "cancelled"


class DoneEvent(_Message):
    type: Literal["done"] = "done"


class ErrorEvent(_Message):
    type: Literal["error"] = "error"
    code: str
    message: str
    segment: int | None = None


ServerEvent = (
    ReadyEvent | StartedEvent | ChunkEvent | SegmentDoneEvent | CancelledEvent | DoneEvent | ErrorEvent
)
