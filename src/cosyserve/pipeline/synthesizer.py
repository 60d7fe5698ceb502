"""The public Python API: text (+ a voice) in, 24 kHz float32 audio out.

    synth = Synthesizer.from_model_dir("pretrained_models/CosyVoice2-0.5B")  # the fastest plan here
    voice = synth.voice_from_audio("prompt.wav", prompt_text="希望你以后能够做的比我还好呦。")
    audio = synth.synthesize(SynthesisRequest("你好。", Mode.ZERO_SHOT, voice=voice))
    for chunk in synth.stream(SynthesisRequest("你好。", Mode.ZERO_SHOT, voice=voice, stream=True)):
        ...

    synth.register_voice("alice", "prompt.wav", prompt_text="希望你以后能够做的比我还好呦。")
    audio = synth.synthesize(SynthesisRequest("你好。", Mode.ZERO_SHOT, voice=synth.voice("alice")))

A synthesizer owns a private engine driven on the caller's thread; a server shares one
engine between requests through :class:`~cosyserve.engine.async_engine.AsyncEngine`.
"""

import dataclasses
import logging
import uuid
from collections.abc import Generator
from pathlib import Path

import numpy as np

from cosyserve.accel.machine import Machine
from cosyserve.accel.plan import Choices, Profile, choose_plan
from cosyserve.engine.config import EngineConfig
from cosyserve.engine.engine import Engine
from cosyserve.engine.loader import LoadedModel, engine_config_for, load_model
from cosyserve.errors import InvalidRequestError
from cosyserve.frontend.audio import AudioSource
from cosyserve.pipeline.frontend import Frontend
from cosyserve.pipeline.request import SynthesisRequest
from cosyserve.pipeline.voice import VoicePrompt, check_voice_name

logger = logging.getLogger(__name__)


class Synthesizer:
    """Synthesis on one loaded model, one request at a time on the calling thread.

    Registered voices live on the instance (never shared between synthesizers); persist
    one with :meth:`VoicePrompt.to_bytes` and bring it back with :meth:`add_voice`.
    """

    def __init__(self, model: LoadedModel, engine_config: EngineConfig | None = None) -> None:
        """``engine_config``: by default one request at a time, with the KV cache in the
        model's precision (:func:`~cosyserve.engine.loader.engine_config_for`)."""
        self.model = model
        self.frontend = Frontend(model)
        config = engine_config or engine_config_for(model, max_active=1)
        self.engine = Engine(model.lm, model.flow, model.hift, config)
        self._voices: dict[str, VoicePrompt] = {}

    @classmethod
    def from_model_dir(
        cls,
        path: Path | str,
        engine_config: EngineConfig | None = None,
        *,
        profile: Profile | str = Profile.AUTO,
        choices: Choices | None = None,
    ) -> "Synthesizer":
        """Load the model at ``path`` as ``profile``'s plan for this machine says, with
        ``choices`` (dtype, quantization, device) overriding it
        (:func:`~cosyserve.accel.plan.choose_plan`, which raises ``PrecisionError`` for a
        choice this machine cannot run). ``profile="exact"`` gives upstream's output."""
        plan = choose_plan(Machine.detect(), profile, choices)
        logger.info("plan: %s", plan.describe())
        return cls(load_model(path, plan), engine_config)

    @property
    def sample_rate(self) -> int:
        return self.model.hparams.sample_rate

    def voice_from_audio(self, audio: AudioSource, prompt_text: str = "", name: str = "") -> VoicePrompt:
        """Compute a voice's prompt features once (reuse the result for many requests)."""
        return self.frontend.voice_from_audio(audio, prompt_text, name)

    def speaker(self, name: str) -> VoicePrompt:
        """A built-in ``spk2info.pt`` speaker (embedding only, for mode ``sft``)."""
        return self.frontend.speaker(name)

    def source_tokens(self, audio: AudioSource) -> tuple[int, ...]:
        """Speech tokens of a recording, for ``SynthesisRequest.source_speech_tokens`` (vc)."""
        return self.frontend.source_tokens(audio)

    def register_voice(self, name: str, audio: AudioSource, prompt_text: str = "") -> VoicePrompt:
        """Compute a recording's prompt features once and keep them under ``name``
        (replacing a voice registered under that name before)."""
        check_voice_name(name)
        return self.add_voice(self.frontend.voice_from_audio(audio, prompt_text, name), name)

    def add_voice(self, voice: VoicePrompt, name: str | None = None) -> VoicePrompt:
        """Register precomputed features (e.g. :meth:`VoicePrompt.from_bytes`) under
        ``name``, by default the voice's own name."""
        name = voice.name if name is None else name
        check_voice_name(name)
        if voice.name != name:
            voice = dataclasses.replace(voice, name=name)
        self._voices[name] = voice
        return voice

    def voice(self, name: str) -> VoicePrompt:
        """A registered voice, else a built-in ``spk2info.pt`` speaker.

        Raises :class:`~cosyserve.pipeline.frontend.UnknownSpeakerError` when ``name`` is neither.
        """
        voice = self._voices.get(name)
        return voice if voice is not None else self.frontend.speaker(name)

    def stream(self, request: SynthesisRequest) -> Generator[np.ndarray, None, None]:
        """Yield float32 mono chunks at :attr:`sample_rate` as they are made (never an empty
        one). Closing the generator early aborts the request."""
        spec = self.frontend.build_spec(request, request_id=uuid.uuid4().hex)
        self.engine.add(spec)
        finished = False
        try:
            while not finished:
                for out in self.engine.step():
                    if out.request_id != spec.request_id:
                        continue
                    if out.error is not None:
                        finished = True
                        raise out.error
                    if out.audio is not None and out.audio.size:
                        yield out.audio
                    finished = out.finished
                if not finished and not self.engine.has_work():
                    raise InvalidRequestError("the request ended without audio")
        finally:
            if not finished:
                self.engine.abort(spec.request_id)

    def synthesize(self, request: SynthesisRequest) -> np.ndarray:
        """The whole waveform, float32 mono at :attr:`sample_rate`."""
        chunks = list(self.stream(request))
        return np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.float32)
