"""What a caller asks for: the synthesis request and its options, validated at the edge."""

from dataclasses import dataclass, field
from enum import StrEnum

from cosyserve.errors import InvalidRequestError
from cosyserve.pipeline.voice import VoicePrompt

MIN_SPEED = 0.5
MAX_SPEED = 2.0
# The vocoder holds back the last 8 mel frames (4 tokens) of every non-final streaming
# chunk for the cross-fade with the next one, so a shorter first chunk emits nothing.
MIN_FIRST_HOP = 5


class Mode(StrEnum):
    """Upstream CosyVoice 2's inference modes."""

    ZERO_SHOT = "zero_shot"  # prompt transcript + prompt audio
    CROSS_LINGUAL = "cross_lingual"  # prompt audio only
    INSTRUCT2 = "instruct2"  # instruction + prompt audio
    SFT = "sft"  # a built-in speaker (embedding only)
    VC = "vc"  # voice conversion: source speech -> the voice's timbre


@dataclass(frozen=True)
class SynthesisOptions:
    """Per-request knobs.

    ``seed``: all randomness of the request (LM sampling, vocoder excitation) derives from
    it; the same seed gives identical audio. None draws a fresh seed.
    ``min_tokens``/``max_tokens``: force the number of speech tokens (like vLLM's
    ignore_eos): stop tokens are masked until ``min_tokens``; useful for benchmarks on
    random weights, which never stop on their own.
    ``first_hop``: streaming only; tokens in the first chunk (lower first-packet latency),
    at least :data:`MIN_FIRST_HOP`; a value above the default first hop has no effect.
    ``speed``: non-streaming only, as upstream (mel-length scaling).
    """

    seed: int | None = None
    speed: float = 1.0
    min_tokens: int | None = None
    max_tokens: int | None = None
    first_hop: int | None = None


@dataclass(frozen=True, eq=False)
class SynthesisRequest:
    """One synthesis job. ``speech_tokens`` skips the LM (forced tokens for the flow);
    mode ``vc`` takes ``source_speech_tokens`` (see ``Synthesizer.source_tokens``)."""

    text: str
    mode: Mode
    voice: VoicePrompt | None = None
    instruct: str = ""
    source_speech_tokens: tuple[int, ...] | None = None
    speech_tokens: tuple[int, ...] | None = None
    stream: bool = False
    options: SynthesisOptions = field(default_factory=SynthesisOptions)

    def validate(self) -> None:
        """Raise :class:`InvalidRequestError` with a stable message for an unusable request."""
        opts = self.options
        if self.mode is not Mode.VC and self.speech_tokens is None and not self.text.strip():
            raise InvalidRequestError("text is empty")
        if self.voice is None:
            raise InvalidRequestError(f"mode {self.mode.value} needs a voice (prompt audio or speaker)")
        needs_audio = self.mode in (Mode.ZERO_SHOT, Mode.CROSS_LINGUAL, Mode.INSTRUCT2, Mode.VC)
        if needs_audio and not self.voice.has_audio_prompt:
            raise InvalidRequestError(
                f"mode {self.mode.value} needs prompt audio, not an embedding-only speaker"
            )
        if self.mode is Mode.ZERO_SHOT and not self.voice.prompt_text_ids:
            raise InvalidRequestError("mode zero_shot needs the prompt audio's transcript (prompt_text)")
        if self.mode is Mode.INSTRUCT2 and not self.instruct.strip():
            raise InvalidRequestError("mode instruct2 needs an instruction")
        if self.mode is Mode.VC and not self.source_speech_tokens:
            raise InvalidRequestError("mode vc needs source audio")
        if self.speech_tokens is not None and not self.speech_tokens:
            raise InvalidRequestError("speech_tokens is empty")
        if opts.seed is not None and not 0 <= opts.seed < 2**64:
            raise InvalidRequestError("seed must be an integer in [0, 2**64)")
        if not MIN_SPEED <= opts.speed <= MAX_SPEED:
            raise InvalidRequestError(f"speed must be between {MIN_SPEED} and {MAX_SPEED}")
        if opts.speed != 1.0 and self.stream:
            raise InvalidRequestError("speed is only supported for non-streaming synthesis")
        for name in ("min_tokens", "max_tokens"):
            value = getattr(opts, name)
            if value is not None and value < 1:
                raise InvalidRequestError(f"{name} must be a positive integer")
        if opts.first_hop is not None and opts.first_hop < MIN_FIRST_HOP:
            raise InvalidRequestError(f"first_hop must be at least {MIN_FIRST_HOP} tokens")
        if opts.min_tokens is not None and opts.max_tokens is not None and opts.min_tokens > opts.max_tokens:
            raise InvalidRequestError("min_tokens must not exceed max_tokens")
