"""The Synthesizer end to end on the tiny model: voices, every mode, seeds, speed, bad input.

Random weights never emit a stop token, so every LM request forces its token count.
One token is 2 mel frames, 960 samples at 24 kHz.
"""

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from cosyserve.accel.plan import Choices, Profile
from cosyserve.errors import InvalidRequestError, PromptAudioError
from cosyserve.pipeline.frontend import UnknownSpeakerError
from cosyserve.pipeline.request import Mode, SynthesisOptions, SynthesisRequest
from cosyserve.pipeline.synthesizer import Synthesizer
from cosyserve.pipeline.voice import VoicePrompt
from tests.pipeline.prompts import PROMPT_TEXT, prompt_wav, speechlike, wav_bytes

SAMPLES_PER_TOKEN = 960
INSTRUCT = "Speak slowly.<|endofprompt|>"
TEXT = "Hello world."
BUILTIN = "中文女"  # a speaker of the generated spk2info.pt


def _request(
    mode: Mode, voice: VoicePrompt | None, *, tokens: int = 10, seed: int = 1, stream: bool = False
) -> SynthesisRequest:
    return SynthesisRequest(
        TEXT,
        mode,
        voice,
        instruct=INSTRUCT if mode is Mode.INSTRUCT2 else "",
        stream=stream,
        options=SynthesisOptions(seed=seed, min_tokens=tokens, max_tokens=tokens),
    )


# -- voices -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def alice(synth: Synthesizer) -> VoicePrompt:
    return synth.register_voice("alice", prompt_wav(), PROMPT_TEXT)


def test_a_registered_voice_is_computed_once_and_resolved_by_name(
    synth: Synthesizer, alice: VoicePrompt
) -> None:
    assert synth.voice("alice") is alice  # the stored features, not a recomputation
    assert alice.name == "alice"
    assert alice.prompt_text_ids and alice.has_audio_prompt


def test_a_second_synthesizer_does_not_see_registered_voices(synth: Synthesizer, alice: VoicePrompt) -> None:
    other = Synthesizer(synth.model)
    with pytest.raises(UnknownSpeakerError):
        other.voice("alice")


@pytest.mark.parametrize("mode", [Mode.ZERO_SHOT, Mode.CROSS_LINGUAL, Mode.INSTRUCT2])
def test_registered_voice_gives_exactly_the_audio_of_the_inline_prompt(
    synth: Synthesizer, alice: VoicePrompt, mode: Mode
) -> None:
    inline = synth.voice_from_audio(prompt_wav(), PROMPT_TEXT)
    by_name = synth.synthesize(_request(mode, synth.voice("alice")))
    passed_inline = synth.synthesize(_request(mode, inline))
    assert by_name.shape == (10 * SAMPLES_PER_TOKEN,)
    assert np.array_equal(by_name, passed_inline)


def test_voice_bytes_round_trip_keeps_features_and_audio(synth: Synthesizer, alice: VoicePrompt) -> None:
    restored = VoicePrompt.from_bytes(alice.to_bytes())
    assert restored.name == "alice" and restored.prompt_text == alice.prompt_text
    assert restored.prompt_text_ids == alice.prompt_text_ids
    assert restored.audio_sha256 == alice.audio_sha256 and len(alice.audio_sha256) == 64
    for field in ("speech_tokens", "mel", "embedding"):
        assert torch.equal(getattr(restored, field), getattr(alice, field)), field
    synth.add_voice(restored, "alice-restored")
    request = _request(Mode.ZERO_SHOT, alice, seed=4)
    expected = synth.synthesize(request)
    got = synth.synthesize(dataclasses.replace(request, voice=synth.voice("alice-restored")))
    assert np.array_equal(got, expected)


def test_builtin_speaker_round_trips_too(synth: Synthesizer) -> None:
    builtin = synth.voice(BUILTIN)
    restored = VoicePrompt.from_bytes(builtin.to_bytes())
    assert not restored.has_audio_prompt
    assert torch.equal(restored.embedding, builtin.embedding) and restored.name == BUILTIN


def _tampered(voice: VoicePrompt, **changes: torch.Tensor) -> bytes:
    from safetensors.torch import save

    tensors = {
        "prompt_text_ids": torch.tensor(voice.prompt_text_ids),
        "speech_tokens": voice.speech_tokens,
        "mel": voice.mel,
        "embedding": voice.embedding,
    }
    return save(tensors | changes, {"format": "cosyserve-voice/1"})


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda v: b"", "voice data is not a cosyserve voice"),
        (lambda v: b"\x10" + bytes(40), "voice data is not a cosyserve voice"),
        (lambda v: v.to_bytes()[:-7], "voice data is not a cosyserve voice"),
        (lambda v: v.to_bytes().replace(b"cosyserve-voice/1", b"cosyserve-voice/9"), "not a cosyserve voice"),
        (lambda v: _tampered(v, mel=v.mel[:, :40].contiguous()), "inconsistent feature shapes"),
        (lambda v: _tampered(v, embedding=torch.zeros(191)), "inconsistent feature shapes"),
        (lambda v: _tampered(v, mel=torch.zeros(0, 80)), "inconsistent feature shapes"),
        (lambda v: _tampered(v, mel=v.mel.double()), "voice data is not a cosyserve voice"),
        (lambda v: _tampered(v, embedding=torch.full((192,), float("nan"))), "non-finite features"),
    ],
)
def test_voice_from_bytes_rejects_anything_else(alice: VoicePrompt, make: object, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        VoicePrompt.from_bytes(make(alice))  # type: ignore[operator]


def test_voice_resolution_order_and_unknown_names(synth: Synthesizer) -> None:
    builtin = synth.voice(BUILTIN)
    assert not builtin.has_audio_prompt and builtin.name == BUILTIN
    assert torch.equal(builtin.embedding, synth.model.speakers[BUILTIN])
    shadow = Synthesizer(synth.model)
    registered = shadow.register_voice(BUILTIN, prompt_wav(seed=5))
    assert shadow.voice(BUILTIN) is registered  # a registered voice comes first
    with pytest.raises(UnknownSpeakerError) as caught:
        synth.voice("nobody")
    assert (str(caught.value), caught.value.code) == ("unknown voice 'nobody'", "unknown_voice")


@pytest.mark.parametrize("name", ["", "a/b", "x" * 65, "dot.ted"])
def test_register_voice_rejects_bad_names_before_any_work(synth: Synthesizer, name: str) -> None:
    with pytest.raises(InvalidRequestError, match="invalid voice name"):
        synth.register_voice(name, b"not even audio")


def test_a_failed_registration_registers_nothing(synth: Synthesizer) -> None:
    with pytest.raises(PromptAudioError):
        synth.register_voice("broken", b"not audio")
    with pytest.raises(UnknownSpeakerError):
        synth.voice("broken")


# -- every mode -------------------------------------------------------------------------------


def _voice_for(mode: Mode, synth: Synthesizer, voice: VoicePrompt) -> VoicePrompt:
    return synth.voice(BUILTIN) if mode is Mode.SFT else voice


@pytest.mark.parametrize("mode", list(Mode))
def test_every_mode_end_to_end_streaming_and_not(synth: Synthesizer, voice: VoicePrompt, mode: Mode) -> None:
    """Same seed, same audio; another seed, other audio; streamed chunks add up to the
    non-streamed length. 36 tokens stream as a first chunk and a final one."""
    tokens = 36
    if mode is Mode.VC:
        source = synth.source_tokens(wav_bytes(speechlike(1.44, seed=9)))
        assert len(source) == tokens  # vc takes its length from the source

    def make(seed: int, stream: bool = False) -> SynthesisRequest:
        if mode is Mode.VC:
            opts = SynthesisOptions(seed=seed)
            return SynthesisRequest("", mode, voice, source_speech_tokens=source, stream=stream, options=opts)
        return _request(mode, _voice_for(mode, synth, voice), tokens=tokens, seed=seed, stream=stream)

    before = synth.engine.stats.snapshot()
    audio = synth.synthesize(make(seed=1))
    again = synth.synthesize(make(seed=1))
    other_seed = synth.synthesize(make(seed=2))
    chunks = list(synth.stream(make(seed=1, stream=True)))
    after = synth.engine.stats

    assert audio.dtype == np.float32 and audio.shape == (tokens * SAMPLES_PER_TOKEN,)
    assert np.isfinite(audio).all() and audio.std() > 1e-3
    assert np.array_equal(audio, again)
    assert other_seed.shape == audio.shape and not np.array_equal(other_seed, audio)
    assert len(chunks) == 2 and all(c.size > 0 for c in chunks)
    assert sum(c.size for c in chunks) == audio.size
    lm_positions = after.decoded_tokens - before.decoded_tokens + after.prefill_tokens - before.prefill_tokens
    assert (lm_positions == 0) == (mode is Mode.VC)


@pytest.mark.parametrize("mode", [Mode.ZERO_SHOT, Mode.SFT])
def test_given_speech_tokens_skip_the_lm(synth: Synthesizer, voice: VoicePrompt, mode: Mode) -> None:
    tokens = tuple(range(100, 112))
    before = synth.engine.stats.snapshot()
    audio = synth.synthesize(SynthesisRequest("", mode, _voice_for(mode, synth, voice), speech_tokens=tokens))
    after = synth.engine.stats
    assert (after.prefill_tokens, after.decoded_tokens) == (before.prefill_tokens, before.decoded_tokens)
    assert after.flow_calls == before.flow_calls + 1
    assert audio.shape == (len(tokens) * SAMPLES_PER_TOKEN,)


def test_speed_scales_the_mel_like_upstream(synth: Synthesizer, voice: VoicePrompt) -> None:
    tokens = tuple(range(200, 212))
    opts = SynthesisOptions(speed=1.5)
    fast_request = SynthesisRequest("", Mode.ZERO_SHOT, voice, speech_tokens=tokens, options=opts)
    fast = synth.synthesize(fast_request)
    # 24 mel frames interpolated to int(24 / 1.5) = 16 frames of 480 samples.
    assert fast.shape == (16 * 480,)
    with pytest.raises(InvalidRequestError, match="speed is only supported for non-streaming synthesis"):
        list(synth.stream(dataclasses.replace(fast_request, stream=True)))


# -- bad input --------------------------------------------------------------------------------


def _bad_requests(voice: VoicePrompt, builtin: VoicePrompt) -> list[tuple[str, SynthesisRequest]]:
    """(stable message, request) pairs."""
    no_transcript = dataclasses.replace(voice, prompt_text_ids=())
    alien_prompt = dataclasses.replace(voice, speech_tokens=voice.speech_tokens + 7000)

    audio_only = "needs prompt audio, not an embedding-only speaker"
    return [
        ("text is empty", SynthesisRequest("", Mode.ZERO_SHOT, voice)),
        ("text is empty", SynthesisRequest("  \n", Mode.SFT, builtin)),
        ("text is empty after normalization", SynthesisRequest("。！？……", Mode.ZERO_SHOT, voice)),
        ("text is empty after normalization", SynthesisRequest("...!!", Mode.CROSS_LINGUAL, voice)),
        ("mode sft needs a voice (prompt audio or speaker)", SynthesisRequest(TEXT, Mode.SFT)),
        (
            "mode zero_shot needs the prompt audio's transcript (prompt_text)",
            SynthesisRequest(TEXT, Mode.ZERO_SHOT, no_transcript),
        ),
        (f"mode zero_shot {audio_only}", SynthesisRequest(TEXT, Mode.ZERO_SHOT, builtin)),
        (f"mode cross_lingual {audio_only}", SynthesisRequest(TEXT, Mode.CROSS_LINGUAL, builtin)),
        (f"mode vc {audio_only}", SynthesisRequest("", Mode.VC, builtin, source_speech_tokens=(1, 2))),
        ("mode instruct2 needs an instruction", SynthesisRequest(TEXT, Mode.INSTRUCT2, voice)),
        ("mode vc needs source audio", SynthesisRequest(TEXT, Mode.VC, voice)),
        ("speech_tokens is empty", SynthesisRequest("", Mode.ZERO_SHOT, voice, speech_tokens=())),
        (
            "speech_tokens must be ids in [0, 6561)",
            SynthesisRequest("", Mode.ZERO_SHOT, voice, speech_tokens=(1, 6561)),
        ),
        (
            "source speech tokens must be ids in [0, 6561)",
            SynthesisRequest("", Mode.VC, voice, source_speech_tokens=(-1, 3)),
        ),
        (
            "the voice's prompt tokens must be ids in [0, 6561)",
            SynthesisRequest(TEXT, Mode.CROSS_LINGUAL, alien_prompt),
        ),
        (
            "first_hop must be at least 5 tokens",
            SynthesisRequest(TEXT, Mode.SFT, builtin, stream=True, options=SynthesisOptions(first_hop=4)),
        ),
        (
            "seed must be an integer in [0, 2**64)",
            SynthesisRequest(TEXT, Mode.SFT, builtin, options=SynthesisOptions(seed=-1)),
        ),
        (
            "min_tokens must not exceed max_tokens",
            SynthesisRequest(TEXT, Mode.SFT, builtin, options=SynthesisOptions(min_tokens=5, max_tokens=4)),
        ),
        (
            "speed must be between 0.5 and 2.0",
            SynthesisRequest(TEXT, Mode.SFT, builtin, options=SynthesisOptions(speed=3.0)),
        ),
    ]


def test_bad_requests_fail_with_their_stable_message_before_any_work(
    synth: Synthesizer, voice: VoicePrompt
) -> None:
    before = synth.engine.stats.snapshot()
    for message, request in _bad_requests(voice, synth.voice(BUILTIN)):
        with pytest.raises(InvalidRequestError) as caught:
            synth.synthesize(request)
        assert (str(caught.value), caught.value.code) == (message, "invalid_request")
    assert synth.engine.stats == before  # nothing reached the engine


@pytest.mark.parametrize(
    ("audio", "message"),
    [
        (b"", "prompt audio is empty"),
        (b"RIFF\x24\x00\x00\x00WAVEfmt garbage", "prompt audio could not be decoded"),
        (b"\x00\x01" * 3000, "prompt audio could not be decoded"),
        (wav_bytes(speechlike(0.2)), "prompt audio is 0.20 s long; at least 0.5 s is required"),
        (
            wav_bytes(speechlike(30.5, rate=8000), rate=8000),
            "prompt audio is longer than the maximum of 30 s",
        ),
        (wav_bytes(np.zeros(16000, dtype=np.float32)), "prompt audio is silent"),
    ],
    ids=["empty", "corrupt-wav", "not-audio", "too-short", "too-long", "silent"],
)
def test_bad_prompt_audio_fails_with_its_stable_message(
    synth: Synthesizer, audio: bytes, message: str
) -> None:
    for use in (
        lambda: synth.voice_from_audio(audio, PROMPT_TEXT),
        lambda: synth.register_voice("rejected", audio, PROMPT_TEXT),
        lambda: synth.source_tokens(audio),
    ):
        with pytest.raises(PromptAudioError) as caught:
            use()
        assert (str(caught.value), caught.value.code) == (message, "invalid_prompt_audio")
    with pytest.raises(UnknownSpeakerError):
        synth.voice("rejected")


def test_from_model_dir_runs_the_fastest_plan_unless_asked_for_exact(tiny_model_dir: Path) -> None:
    fast = Synthesizer.from_model_dir(tiny_model_dir)
    assert (
        fast.model.plan.profile is Profile.AUTO and fast.engine.config.first_hop == fast.model.plan.first_hop
    )
    exact = Synthesizer.from_model_dir(tiny_model_dir, profile="exact", choices=Choices(quantize="int8"))
    assert exact.model.plan.profile is Profile.EXACT and exact.engine.config.hop_growth
    assert exact.model.precision.quantize == "int8"
