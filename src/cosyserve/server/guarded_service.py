"""The speech service with the input guard and per-identity audio metering applied.

Every transport (HTTP, WebSocket, gRPC) reaches synthesis and voice registration through
the service, so applying both here covers them all: text is checked (or masked) by the
:class:`~cosyserve.server.guard.InputGuard` before any work, the caller's audio allowance
is checked before admission, and each chunk's duration is charged to the caller's
:class:`~cosyserve.server.auth.ratelimit.UsageMeter` as it is made.
"""

import dataclasses
from collections.abc import AsyncGenerator
from contextlib import aclosing

from cosyserve.engine.async_engine import AsyncEngine, AudioChunk
from cosyserve.engine.loader import LoadedModel
from cosyserve.pipeline.voice import VoicePrompt
from cosyserve.server.auth.ratelimit import current_usage
from cosyserve.server.guard import InputGuard
from cosyserve.server.service import ServiceLimits, SpeechParams, SpeechService, VoiceRegistry


class GuardedService(SpeechService):
    """:class:`SpeechService` behind ``guard`` and the current request's usage meter."""

    def __init__(
        self,
        model: LoadedModel,
        engine: AsyncEngine,
        voices: VoiceRegistry,
        limits: ServiceLimits | None = None,
        frontend_threads: int = 2,
        *,
        guard: InputGuard,
        default_voice: str = "",
    ) -> None:
        super().__init__(model, engine, voices, limits, frontend_threads, default_voice)
        self.guard = guard
        audio = self.frontend.audio_limits
        self.frontend.audio_limits = dataclasses.replace(
            audio,
            min_duration_s=min(audio.min_duration_s, guard.max_prompt_audio_s),
            max_duration_s=guard.max_prompt_audio_s,
        )

    async def synthesize(self, params: SpeechParams) -> AsyncGenerator[AudioChunk, None]:
        params = self.guard.check_params(params)
        meter = current_usage.get()
        if meter is not None:
            meter.check()
        async with aclosing(super().synthesize(params)) as chunks:
            async for chunk in chunks:
                if meter is not None:
                    meter.charge(chunk.audio.size / self.sample_rate)
                yield chunk

    async def add_voice(self, name: str, audio: bytes, prompt_text: str) -> VoicePrompt:
        return await super().add_voice(name, audio, self.guard.check_text(prompt_text, "prompt_text"))
