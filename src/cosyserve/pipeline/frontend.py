"""Turns a :class:`SynthesisRequest` into what the engine runs (upstream CosyVoiceFrontEnd).

Modes differ only in what the LM and the flow see (upstream-spec 3.6):

=============  ===========================================  ===========================
mode           LM input                                      flow prompt
=============  ===========================================  ===========================
zero_shot      [sos] prompt_text+text [task] prompt_speech  prompt tokens + mel + x-vec
cross_lingual  [sos] text [task]                             prompt tokens + mel + x-vec
instruct2      [sos] instruct<|endofprompt|>+text [task]     prompt tokens + mel + x-vec
sft            [sos] text [task]                             x-vector only
vc             (no LM: the source audio's speech tokens)     prompt tokens + mel + x-vec
=============  ===========================================  ===========================

CosyVoice 3 adds its system prompt ahead of the text where no ``<|endofprompt|>`` is
given (:mod:`cosyserve.pipeline.llm_prompt`).
"""

import hashlib
import secrets
from pathlib import Path

import torch

from cosyserve.engine.loader import LoadedModel
from cosyserve.engine.request import GenerationSpec, Segment
from cosyserve.errors import InvalidRequestError
from cosyserve.frontend.audio import AudioSource, PromptAudioLimits, load_prompt_audio
from cosyserve.frontend.pronunciation import Pronunciations
from cosyserve.frontend.text_normalizer import TextNormalizer
from cosyserve.frontend.text_tokens import COSYVOICE3_SPECIAL_TOKENS, SPECIAL_TOKENS
from cosyserve.modeldir.family import Family
from cosyserve.pipeline.llm_prompt import END_OF_PROMPT, instruction, split_text_prompt, system_prompt
from cosyserve.pipeline.request import Mode, SynthesisRequest
from cosyserve.pipeline.voice import VoicePrompt


class UnknownSpeakerError(InvalidRequestError):
    code = "unknown_voice"


class Frontend:
    """Text normalisation, tokenisation and prompt features for one loaded model."""

    def __init__(
        self,
        model: LoadedModel,
        audio_limits: PromptAudioLimits | None = None,
        pronunciations: Pronunciations | None = None,
    ) -> None:
        """``pronunciations``: words to say as the operator's dictionary says; replace the
        attribute to reload it (requests that started keep what they read)."""
        self.model = model
        self.pronunciations = pronunciations or Pronunciations.empty()
        # CosyVoice 3's prompt marker and system prompt as ids: the same for every request.
        self._end_of_prompt = set(self._encode(END_OF_PROMPT))
        self._system_prompt = self._encode(system_prompt())
        cosyvoice3 = model.model_dir.family is Family.COSYVOICE3
        self.normalizer = TextNormalizer(COSYVOICE3_SPECIAL_TOKENS if cosyvoice3 else SPECIAL_TOKENS)
        self.audio_limits = audio_limits or PromptAudioLimits()

    # -- voices -----------------------------------------------------------------------------

    def voice_from_audio(
        self, audio: AudioSource, prompt_text: str = "", name: str = "", *, align: bool = True
    ) -> VoicePrompt:
        """Prompt features of a recording; ``prompt_text`` is its transcript (zero_shot)."""
        raw = audio if isinstance(audio, bytes) else Path(audio).read_bytes()
        wav, rate = load_prompt_audio(raw, self.audio_limits)
        feats = self.model.features(wav, rate, align=align)
        text = self.normalizer.normalize(prompt_text) if prompt_text.strip() else ""
        return VoicePrompt(
            prompt_text_ids=tuple(self.model.tokenizer.encode(text)) if text else (),
            speech_tokens=feats.speech_token.reshape(-1).to(torch.long),
            mel=feats.speech_feat.reshape(-1, feats.speech_feat.shape[-1]).float(),
            embedding=feats.embedding.reshape(-1).float(),
            name=name,
            audio_sha256=hashlib.sha256(raw).hexdigest(),
            prompt_text=text,
        )

    def speaker(self, name: str) -> VoicePrompt:
        embedding = self.model.speakers.get(name)
        if embedding is None:
            raise UnknownSpeakerError(f"unknown voice {name!r}")
        return VoicePrompt.from_embedding(embedding, name)

    def source_tokens(self, audio: AudioSource) -> tuple[int, ...]:
        """Speech tokens of a recording (the source of voice conversion)."""
        raw = audio if isinstance(audio, bytes) else Path(audio).read_bytes()
        wav, rate = load_prompt_audio(raw, self.audio_limits)
        feats = self.model.features(wav, rate, align=False)
        return tuple(int(t) for t in feats.speech_token.reshape(-1).tolist())

    # -- text -------------------------------------------------------------------------------

    def text_segments(self, text: str) -> list[tuple[int, ...]]:
        """Normalise and split ``text`` into sentences, as Qwen2 ids each."""
        tokenizer = self.model.tokenizer
        text = self.pronunciations.apply(text)
        sentences = self.normalizer.normalize_and_split(text, token_count=lambda s: len(tokenizer.encode(s)))
        segments = [tuple(tokenizer.encode(s)) for s in sentences]
        segments = [s for s in segments if s]
        if not segments:
            raise InvalidRequestError("text is empty after normalization")
        return segments

    # -- requests ---------------------------------------------------------------------------

    def build_spec(self, request: SynthesisRequest, request_id: str) -> GenerationSpec:
        """Validate ``request`` and prepare everything the engine needs for it."""
        request.validate()
        voice = request.voice
        assert voice is not None  # validate() guarantees it
        mode = request.mode
        self._check_speech_tokens(voice, request)
        cosyvoice3 = self.model.model_dir.family is Family.COSYVOICE3
        head: tuple[int, ...] = ()
        if mode is Mode.VC:
            assert request.source_speech_tokens is not None
            segments: tuple[Segment, ...] = (Segment(speech_tokens=request.source_speech_tokens),)
        elif request.speech_tokens is not None:
            segments = (Segment(speech_tokens=request.speech_tokens),)
        else:
            text = request.text
            if cosyvoice3:
                prompt = split_text_prompt(text)
                head, text = self._encode(prompt.head), prompt.body
            segments = tuple(Segment(text_ids=head + ids) for ids in self.text_segments(text))
        prefix: tuple[int, ...] = ()
        prompt_speech: tuple[int, ...] = ()
        if mode is Mode.ZERO_SHOT:
            prefix = voice.prompt_text_ids
            prompt_speech = tuple(int(t) for t in voice.speech_tokens.tolist())
        elif mode is Mode.INSTRUCT2:
            # Upstream does not normalise the instruction; the marker ends it.
            prefix = self._encode(instruction(request.instruct, cosyvoice3))
        if cosyvoice3 and not head and not self._end_of_prompt <= set(prefix):
            prefix = self._system_prompt + prefix
        with_prompt = mode is not Mode.SFT
        opts = request.options
        return GenerationSpec(
            request_id=request_id,
            segments=segments,
            embedding=voice.embedding,
            flow_prompt_tokens=voice.speech_tokens if with_prompt else torch.zeros(0, dtype=torch.long),
            flow_prompt_mel=voice.mel if with_prompt else torch.zeros(0, voice.mel.shape[-1]),
            lm_prefix_ids=prefix,
            lm_prompt_speech=prompt_speech,
            seed=opts.seed if opts.seed is not None else secrets.randbits(63),
            stream=request.stream,
            speed=opts.speed,
            first_hop=opts.first_hop,
            min_tokens=opts.min_tokens,
            max_tokens=opts.max_tokens,
        )

    def _encode(self, text: str) -> tuple[int, ...]:
        return tuple(self.model.tokenizer.encode(text)) if text else ()

    def _check_speech_tokens(self, voice: VoicePrompt, request: SynthesisRequest) -> None:
        """Given speech tokens must be ids the flow knows (a stored voice or a caller's
        token list may come from anywhere)."""
        vocab = self.model.hparams.lm.speech_token_size
        given = {
            "speech_tokens": request.speech_tokens or (),
            "source speech tokens": request.source_speech_tokens or (),
            "the voice's prompt tokens": voice.speech_tokens.tolist(),
        }
        for what, tokens in given.items():
            if tokens and not 0 <= min(tokens) <= max(tokens) < vocab:
                raise InvalidRequestError(f"{what} must be ids in [0, {vocab})")
