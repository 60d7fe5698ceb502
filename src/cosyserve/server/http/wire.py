"""Pydantic models of what the HTTP routes accept and return (the wire format only).

Limits that depend on settings (text length) are checked by the routes; the schema holds
the fixed ones. Converting to the service's :class:`~cosyserve.server.service.SpeechParams`
happens in the routes.
"""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from cosyserve.audio import MAX_SAMPLE_RATE, MIN_SAMPLE_RATE, AudioFormat

# OpenAI accepts 0.25-4.0; the model supports a narrower range, checked by the service
# with a clear message.
_OPENAI_MIN_SPEED = 0.25
_OPENAI_MAX_SPEED = 4.0
# Upper bound of forced speech tokens (25 per second of audio): 10 minutes.
MAX_FORCED_TOKENS = 15_000


class VoiceRef(BaseModel):
    """OpenAI's custom-voice form of ``voice``: ``{"id": "name"}``."""

    model_config = ConfigDict(extra="forbid")

    id: str = Field(min_length=1, max_length=64)


class SpeechRequest(BaseModel):
    """``POST /v1/audio/speech``: OpenAI's fields, then cosyserve's extensions.

    OpenAI: ``model`` (the served model's id or family name; with one model served any
    name is accepted), ``input``, ``voice``
    (a registered voice or a built-in speaker, by name or as ``{"id": name}``),
    ``response_format``, ``speed`` (non-streaming only), ``instructions`` (CosyVoice 2's
    instruct2 mode, e.g. "用四川话说这句话"), ``stream_format`` (``sse``: server-sent
    events with base64 audio).
    Extensions: ``sample_rate`` (8000-48000, resampled), ``stream`` (send audio bytes
    as they are made instead of the whole file), ``seed`` (same seed, same audio),
    ``min_tokens``/``max_tokens`` (force the speech-token count per sentence, for
    benchmarks on random weights), ``first_hop`` (tokens in the first streamed chunk).
    """

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=256)
    input: str = Field(min_length=1)
    voice: str | VoiceRef = Field(union_mode="left_to_right")  # names are checked by the service
    response_format: AudioFormat = "mp3"
    speed: float = Field(1.0, ge=_OPENAI_MIN_SPEED, le=_OPENAI_MAX_SPEED)
    instructions: str | None = Field(None, max_length=4096)
    stream_format: Literal["audio", "sse"] = "audio"
    sample_rate: int | None = Field(None, ge=MIN_SAMPLE_RATE, le=MAX_SAMPLE_RATE)
    stream: bool = False
    seed: int | None = Field(None, ge=0, lt=2**63)
    min_tokens: int | None = Field(None, ge=1, le=MAX_FORCED_TOKENS)
    max_tokens: int | None = Field(None, ge=1, le=MAX_FORCED_TOKENS)
    first_hop: int | None = Field(None, ge=1, le=MAX_FORCED_TOKENS)

    @property
    def voice_name(self) -> str:
        return self.voice if isinstance(self.voice, str) else self.voice.id


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "cosyserve"


class ModelList(BaseModel):
    """``GET /v1/models``."""

    object: Literal["list"] = "list"
    data: list[ModelCard]


class Health(BaseModel):
    """``GET /health``: the process answers. ``plan``: the speed plan it runs (its fields as
    text, see :meth:`cosyserve.accel.plan.Plan.labels`), once chosen at start: the default
    model's. ``plans``: each loaded model's, by model id."""

    status: Literal["ok"] = "ok"
    plan: dict[str, str] | None = None
    plans: dict[str, dict[str, str]] = Field(default_factory=dict)


class Readiness(BaseModel):
    """``GET /ready``: 200 when ``status`` is ``ready``, else 503.

    ``status``: starting | ready | draining | stopped | failed | engine_dead.
    ``in_flight``: requests admitted and not finished (synthesising or queued);
    ``engine_requests``: requests inside the engine; ``capacity``: max_active + max_queued.
    With several models served, ``model`` is the default's id, the counts add up every
    model's, ``capacity`` is per model, and ``models`` tells each one's state by id:
    ``loading``, ``warming_up``, ``ready`` or ``engine_dead``.
    """

    status: str
    model: str
    engine_alive: bool
    in_flight: int
    engine_requests: int
    capacity: int
    models: dict[str, str] = Field(default_factory=dict)
