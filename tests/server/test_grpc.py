"""The gRPC server end to end: a real server on a loopback port over the tiny model,
called with the generated client stubs (upstream's requests shaped exactly as its
``runtime/python/grpc/client.py`` builds them)."""

import asyncio
import hashlib
import io
import socket
import sqlite3
import subprocess
import sys
import threading
import time
import wave
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import av
import grpc
import numpy as np
import pytest
import soundfile

from cosyserve.audio import content_type, to_pcm16
from cosyserve.engine.async_engine import AsyncEngine
from cosyserve.engine.config import EngineConfig
from cosyserve.engine.engine import Engine
from cosyserve.engine.loader import LoadedModel, load_model
from cosyserve.pipeline.request import SynthesisOptions
from cosyserve.server.grpc import GrpcConfig, start_grpc_server
from cosyserve.server.grpc.protos import (
    cosyserve_v1_pb2,
    cosyserve_v1_pb2_grpc,
    cosyvoice_pb2,
    cosyvoice_pb2_grpc,
)
from cosyserve.server.service import ServiceLimits, SpeechParams, SpeechService
from cosyserve.voices.sqlite import SqliteVoiceStore

T = TypeVar("T")
TOKENS = 8  # forced speech tokens per request: random weights never stop on their own
SAMPLES_PER_TOKEN = 960  # 2 mel frames of 480 samples at 24 kHz
SEED = 1234
RETRY_AFTER_S = 3
BUILTIN = "中文女"  # a spk2info.pt speaker of the generated tiny model
PROMPT_TEXT = "hello there, how are you?"
V1 = cosyserve_v1_pb2
REPO = Path(__file__).resolve().parents[2]


def speechlike(seconds: float = 0.8, rate: int = 16000, seed: int = 0) -> np.ndarray:
    """(N,) float32 in [-0.4, 0.4]: a gliding harmonic tone in syllable-like bursts plus noise."""
    gen = np.random.default_rng(seed)
    t = np.arange(round(seconds * rate)) / rate
    phase = 2 * np.pi * np.cumsum(120 + 40 * np.sin(2 * np.pi * 1.5 * t)) / rate
    voiced = sum(np.sin(k * phase) / k for k in range(1, 6))
    signal = 0.15 * (0.55 + 0.45 * np.sin(2 * np.pi * 4 * t)) * voiced + 0.01 * gen.standard_normal(t.size)
    return signal.astype(np.float32)


def prompt_pcm16() -> bytes:
    """The prompt as upstream's client sends it: ``(load_wav(..., 16000) * 2**15).astype(int16)``."""
    return (speechlike() * (2**15)).astype(np.int16).tobytes()


def prompt_wav() -> bytes:
    """The same samples in a 16 kHz mono WAV file (what v1 clients upload)."""
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(prompt_pcm16())
    return out.getvalue()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class GrpcEnv:
    model: LoadedModel
    engine: AsyncEngine
    service: SpeechService
    loop: asyncio.AbstractEventLoop
    upstream: cosyvoice_pb2_grpc.CosyVoiceStub
    speech: cosyserve_v1_pb2_grpc.SpeechStub

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the server's event loop and wait for it."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=60)

    def wait_idle(self, service: SpeechService | None = None, timeout: float = 20.0) -> None:
        """Until the service has no request in flight and the engine none in progress."""
        service = service or self.service
        deadline = time.monotonic() + timeout
        while service.in_flight or self.engine.active_requests:
            assert time.monotonic() < deadline, "requests still in flight"
            time.sleep(0.01)


@pytest.fixture(scope="module")
def env(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GrpcEnv]:
    model = load_model(tiny_model_dir)
    # One request at a time and no queue: the overload test needs only two calls.
    config = EngineConfig(max_active=1, max_waiting=0, max_len=512)
    engine = AsyncEngine(Engine(model.lm, model.flow, model.hift, config))
    store = SqliteVoiceStore(tmp_path_factory.mktemp("grpc") / "voices.db")
    limits = ServiceLimits(retry_after_s=RETRY_AFTER_S)
    service = SpeechService(model, engine, store, limits, frontend_threads=1)
    loop = asyncio.new_event_loop()
    loop_thread = threading.Thread(target=loop.run_forever, name="test-grpc-loop")
    engine.start()
    loop_thread.start()
    config = GrpcConfig(
        upstream_options=SynthesisOptions(seed=SEED, min_tokens=TOKENS, max_tokens=TOKENS), max_text_chars=100
    )
    port = free_port()
    grpc_server = None
    try:
        grpc_server = asyncio.run_coroutine_threadsafe(
            start_grpc_server(service, "127.0.0.1", port, config), loop
        ).result(timeout=30)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield GrpcEnv(
                model,
                engine,
                service,
                loop,
                cosyvoice_pb2_grpc.CosyVoiceStub(channel),
                cosyserve_v1_pb2_grpc.SpeechStub(channel),
            )
    finally:
        if grpc_server is not None:
            asyncio.run_coroutine_threadsafe(grpc_server.stop(None), loop).result(timeout=30)
        engine.shutdown()
        service.close()
        store.close()
        loop.call_soon_threadsafe(loop.stop)
        loop_thread.join(timeout=10)
        loop.close()
        assert not loop_thread.is_alive() and not engine.alive


def status_of(call: Any) -> tuple[grpc.StatusCode, str, dict[str, str]]:
    """Consume ``call`` (a response iterator or a unary call) and return its error."""
    with pytest.raises(grpc.RpcError) as info:
        for _ in call() if callable(call) else call:
            pass
    error: Any = info.value
    return error.code(), error.details(), dict(error.trailing_metadata() or ())


# -- upstream's proto -----------------------------------------------------------------------


def upstream_request(mode: str, tts_text: str = "hello world", spk_id: str = BUILTIN) -> Any:
    """A request built the way upstream's client.py builds it."""
    request = cosyvoice_pb2.Request()
    if mode == "sft":
        sft_request = cosyvoice_pb2.sftRequest()
        sft_request.spk_id = spk_id
        sft_request.tts_text = tts_text
        request.sft_request.CopyFrom(sft_request)
    elif mode == "zero_shot":
        zero_shot_request = cosyvoice_pb2.zeroshotRequest()
        zero_shot_request.tts_text = tts_text
        zero_shot_request.prompt_text = PROMPT_TEXT
        zero_shot_request.prompt_audio = prompt_pcm16()
        request.zero_shot_request.CopyFrom(zero_shot_request)
    elif mode == "cross_lingual":
        cross_lingual_request = cosyvoice_pb2.crosslingualRequest()
        cross_lingual_request.tts_text = tts_text
        cross_lingual_request.prompt_audio = prompt_pcm16()
        request.cross_lingual_request.CopyFrom(cross_lingual_request)
    else:
        instruct_request = cosyvoice_pb2.instructRequest()
        instruct_request.tts_text = tts_text
        instruct_request.spk_id = spk_id
        instruct_request.instruct_text = "Theo 'Crimson', is a fiery, passionate rebel leader."
        request.instruct_request.CopyFrom(instruct_request)
    return request


def upstream_audio(env: GrpcEnv, request: Any) -> tuple[bytes, int]:
    """All of the response's PCM bytes (as upstream's client joins them) and the message count."""
    messages = [r.tts_audio for r in env.upstream.Inference(request)]
    return b"".join(messages), len(messages)


def direct_pcm(env: GrpcEnv, params: SpeechParams) -> bytes:
    """The service's own audio for ``params``, quantised as the wire carries it."""

    async def collect() -> np.ndarray:
        return np.concatenate([chunk.audio async for chunk in env.service.synthesize(params)])

    return to_pcm16(env.run(collect())).tobytes()


@pytest.mark.parametrize("mode", ["sft", "zero_shot", "cross_lingual"])
def test_upstream_modes_stream_int16_pcm_at_24k(env: GrpcEnv, mode: str) -> None:
    audio, messages = upstream_audio(env, upstream_request(mode))
    assert len(audio) == TOKENS * SAMPLES_PER_TOKEN * 2
    assert messages >= 1
    samples = np.frombuffer(audio, dtype="<i2")
    assert np.abs(samples.astype(np.int32)).max() > 0
    # The server's fixed upstream options (seed included) make the audio reproducible.
    assert upstream_audio(env, upstream_request(mode))[0] == audio


def test_upstream_audio_is_the_services_audio_quantised(env: GrpcEnv) -> None:
    audio, _ = upstream_audio(env, upstream_request("sft"))
    options = SynthesisOptions(seed=SEED, min_tokens=TOKENS, max_tokens=TOKENS)
    assert audio == direct_pcm(env, SpeechParams(text="hello world", voice=BUILTIN, options=options))


def test_upstream_streams_chunks_as_they_are_made(env: GrpcEnv) -> None:
    request = upstream_request("sft")
    # A longer request (over a second of audio) arrives in several messages.
    config = GrpcConfig(upstream_options=SynthesisOptions(seed=SEED, min_tokens=60, max_tokens=60))
    port = free_port()
    extra = env.run(start_grpc_server(env.service, "127.0.0.1", port, config))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            messages = [r.tts_audio for r in cosyvoice_pb2_grpc.CosyVoiceStub(channel).Inference(request)]
    finally:
        env.run(extra.stop(None))
    assert len(messages) > 1
    assert sum(len(m) for m in messages) == 60 * SAMPLES_PER_TOKEN * 2


@pytest.mark.parametrize(
    ("request_", "code", "message"),
    [
        (upstream_request("instruct"), grpc.StatusCode.UNIMPLEMENTED, "CosyVoice 2 does not have"),
        (cosyvoice_pb2.Request(), grpc.StatusCode.INVALID_ARGUMENT, "no payload"),
        (upstream_request("sft", tts_text=""), grpc.StatusCode.INVALID_ARGUMENT, "text is empty"),
        (upstream_request("sft", spk_id="nobody"), grpc.StatusCode.NOT_FOUND, "unknown voice"),
        (
            cosyvoice_pb2.Request(
                zero_shot_request=cosyvoice_pb2.zeroshotRequest(tts_text="hi", prompt_audio=prompt_pcm16())
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "transcript",
        ),
        (
            cosyvoice_pb2.Request(
                cross_lingual_request=cosyvoice_pb2.crosslingualRequest(
                    tts_text="hi", prompt_audio=b"\x01\x02\x03"
                )
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "16-bit PCM",
        ),
    ],
    ids=["instruct-v1", "no-payload", "empty-text", "unknown-speaker", "zero-shot-no-transcript", "odd-pcm"],
)
def test_upstream_errors(env: GrpcEnv, request_: Any, code: grpc.StatusCode, message: str) -> None:
    got_code, details, _ = status_of(env.upstream.Inference(request_))
    assert got_code == code
    assert message in details
    env.wait_idle()


# -- cosyserve.v1.Speech --------------------------------------------------------------------


def v1_request(**fields: Any) -> Any:
    fields.setdefault("text", "hello world")
    fields.setdefault("seed", SEED)
    fields.setdefault("min_tokens", TOKENS)
    fields.setdefault("max_tokens", TOKENS)
    if "prompt_audio" not in fields:
        fields.setdefault("voice", BUILTIN)
    return V1.SynthesizeRequest(**fields)


def synthesize(env: GrpcEnv, **fields: Any) -> tuple[bytes, list[Any]]:
    responses = list(env.speech.Synthesize(v1_request(**fields)))
    return b"".join(r.audio for r in responses), responses


def decode(data: bytes) -> tuple[np.ndarray, int]:
    """(samples, rate) of an encoded file, mono float."""
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        frames = [frame.to_ndarray().reshape(-1) for frame in container.decode(stream)]
        return np.concatenate(frames).astype(np.float32), stream.codec_context.sample_rate


@pytest.mark.parametrize(
    ("fmt", "rate", "encoded_rate"),
    [
        ("", None, 24000),  # the default: raw PCM at the model's rate
        ("wav", 16000, 16000),
        ("flac", 48000, 48000),
        ("mp3", 22050, 22050),
        ("opus", 20000, 24000),  # Opus encodes at the next rate it supports
        ("aac", 44100, 44100),
    ],
)
def test_v1_formats_and_rates(env: GrpcEnv, fmt: str, rate: int | None, encoded_rate: int) -> None:
    fields: dict[str, Any] = {"format": fmt} if rate is None else {"format": fmt, "sample_rate": rate}
    data, responses = synthesize(env, **fields)
    first = responses[0]
    assert first.content_type == content_type(fmt or "pcm") and first.sample_rate == encoded_rate
    assert all(not r.content_type and not r.sample_rate for r in responses[1:])
    seconds = TOKENS * SAMPLES_PER_TOKEN / 24000
    if fmt == "":
        samples = np.frombuffer(data, dtype="<i2")
        assert samples.size == TOKENS * SAMPLES_PER_TOKEN
        upstream, _ = upstream_audio(env, upstream_request("sft"))
        assert data == upstream  # same voice, seed and tokens as the server's upstream options
        return
    if fmt in ("wav", "flac"):  # lossless: every sample, resampled
        decoded, decoded_rate = decode(data)
        assert decoded.shape == (round(seconds * encoded_rate),)
    else:
        decoded, decoded_rate = decode(data)
        # Lossy codecs add priming and padding; the length stays near the audio's.
        assert abs(decoded.size / decoded_rate - seconds) < 0.1
    assert decoded_rate == (48000 if fmt == "opus" else encoded_rate)  # Ogg Opus decodes at 48 kHz
    assert np.abs(decoded).max() > 0


def test_v1_stream_false_sends_one_complete_file(env: GrpcEnv) -> None:
    data, responses = synthesize(env, format="wav", stream=False, speed=1.0)
    assert len(responses) == 1
    info = soundfile.info(io.BytesIO(data))
    assert (info.samplerate, info.frames) == (24000, TOKENS * SAMPLES_PER_TOKEN)


def test_v1_modes_from_inline_prompt(env: GrpcEnv) -> None:
    zero_shot, _ = synthesize(env, prompt_audio=prompt_wav(), prompt_text=PROMPT_TEXT)
    cross, _ = synthesize(env, prompt_audio=prompt_wav(), mode=V1.MODE_CROSS_LINGUAL)
    instruct, _ = synthesize(env, prompt_audio=prompt_wav(), instruct="用开心的语气说")
    # The upstream proto's zero-shot and cross-lingual requests carry the same prompt samples.
    assert zero_shot == upstream_audio(env, upstream_request("zero_shot"))[0]
    assert cross == upstream_audio(env, upstream_request("cross_lingual"))[0]
    assert len(instruct) == TOKENS * SAMPLES_PER_TOKEN * 2 and instruct not in (zero_shot, cross)


def test_v1_voice_registry(env: GrpcEnv) -> None:
    wav = prompt_wav()
    before = time.time()
    added = env.speech.AddVoice(V1.AddVoiceRequest(name="grpc_alice", audio=wav, prompt_text=PROMPT_TEXT))
    assert (added.name, added.kind) == ("grpc_alice", V1.VOICE_KIND_REGISTERED)
    assert added.audio_sha256 == hashlib.sha256(wav).hexdigest() and added.prompt_text
    assert before - 1 <= added.created_at.ToNanoseconds() / 1e9 <= time.time() + 1
    try:
        listed = {v.name: v for v in env.speech.ListVoices(V1.ListVoicesRequest()).voices}
        assert listed["grpc_alice"] == added
        builtins = {name for name, v in listed.items() if v.kind == V1.VOICE_KIND_BUILTIN}
        assert builtins == set(env.model.speakers)
        # A registered voice synthesises exactly like the same prompt given inline.
        by_name, _ = synthesize(env, voice="grpc_alice")
        inline, _ = synthesize(env, prompt_audio=wav, prompt_text=PROMPT_TEXT)
        assert by_name == inline
        code, _, meta = status_of(
            lambda: [env.speech.AddVoice(V1.AddVoiceRequest(name="grpc_alice", audio=wav))]
        )
        assert code == grpc.StatusCode.ALREADY_EXISTS and meta["cosyserve-error-code"] == "voice_exists"
    finally:
        env.speech.DeleteVoice(V1.DeleteVoiceRequest(name="grpc_alice"))
    assert "grpc_alice" not in {v.name for v in env.speech.ListVoices(V1.ListVoicesRequest()).voices}
    code, _, _ = status_of(lambda: [env.speech.DeleteVoice(V1.DeleteVoiceRequest(name="grpc_alice"))])
    assert code == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize(
    ("fields", "code", "message"),
    [
        ({"voice": "nobody"}, grpc.StatusCode.NOT_FOUND, "unknown voice"),
        ({"text": ""}, grpc.StatusCode.INVALID_ARGUMENT, "text is empty"),
        ({"text": "x" * 101}, grpc.StatusCode.INVALID_ARGUMENT, "longer than 100"),
        ({"voice": "../etc"}, grpc.StatusCode.INVALID_ARGUMENT, "invalid voice name"),
        ({"format": "ogg"}, grpc.StatusCode.INVALID_ARGUMENT, "unsupported audio format"),
        ({"format": "mp3", "sample_rate": 20000}, grpc.StatusCode.INVALID_ARGUMENT, "20000 Hz"),
        (
            {"prompt_audio": b"not audio at all", "voice": BUILTIN},
            grpc.StatusCode.INVALID_ARGUMENT,
            "not both",
        ),
        (
            {"prompt_audio": b"not audio at all" * 100},
            grpc.StatusCode.INVALID_ARGUMENT,
            "could not be decoded",
        ),
        ({"mode": V1.MODE_ZERO_SHOT}, grpc.StatusCode.INVALID_ARGUMENT, "needs prompt audio"),
        ({"speed": 1.5}, grpc.StatusCode.INVALID_ARGUMENT, "non-streaming"),
    ],
    ids=[
        "unknown-voice",
        "empty-text",
        "long-text",
        "bad-name",
        "bad-format",
        "bad-rate",
        "voice-and-prompt",
        "bad-prompt",
        "mode-needs-audio",
        "speed-streaming",
    ],
)
def test_v1_errors(env: GrpcEnv, fields: dict[str, Any], code: grpc.StatusCode, message: str) -> None:
    got_code, details, meta = status_of(env.speech.Synthesize(v1_request(**fields)))
    assert got_code == code
    assert message in details
    assert meta["cosyserve-error-code"]
    env.wait_idle()


def test_v1_internal_errors_say_nothing_internal(env: GrpcEnv) -> None:
    store = env.service.voices
    assert isinstance(store, SqliteVoiceStore)
    env.speech.AddVoice(V1.AddVoiceRequest(name="grpc_broken", audio=prompt_wav(), prompt_text=PROMPT_TEXT))
    with sqlite3.connect(store.path) as conn:
        conn.execute("UPDATE voices SET mel = ? WHERE name = 'grpc_broken'", (b"garbage",))
    try:
        code, details, meta = status_of(env.speech.Synthesize(v1_request(voice="grpc_broken")))
    finally:
        env.speech.DeleteVoice(V1.DeleteVoiceRequest(name="grpc_broken"))
    assert (code, details, meta["cosyserve-error-code"]) == (
        grpc.StatusCode.INTERNAL,
        "internal server error",
        "internal_error",
    )
    env.wait_idle()


def test_overload_is_refused_at_once_with_retry_info(env: GrpcEnv) -> None:
    long_call = env.speech.Synthesize(v1_request(min_tokens=400, max_tokens=400))
    next(long_call)  # admitted and synthesising: the only place is taken
    try:
        start = time.monotonic()
        code, _, meta = status_of(env.speech.Synthesize(v1_request()))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert meta["retry-after"] == str(RETRY_AFTER_S) and meta["cosyserve-error-code"] == "overloaded"
        assert time.monotonic() - start < 5  # refused, not queued behind the long request
        code, _, _ = status_of(env.upstream.Inference(upstream_request("sft")))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        long_call.cancel()
    env.wait_idle()


def test_client_cancellation_aborts_the_engine_request(env: GrpcEnv) -> None:
    decoded_before = env.engine.engine.stats.snapshot().decoded_tokens
    call = env.speech.Synthesize(v1_request(min_tokens=400, max_tokens=400))
    next(call)
    assert env.service.in_flight == 1
    call.cancel()
    env.wait_idle()
    assert not env.engine.engine.has_work()
    # Aborted well before its 400 tokens were made.
    assert env.engine.engine.stats.snapshot().decoded_tokens - decoded_before < 400
    # The place is free again.
    assert len(synthesize(env)[0]) == TOKENS * SAMPLES_PER_TOKEN * 2


def test_deadline_exceeded(env: GrpcEnv) -> None:
    hasty = SpeechService(
        env.model, env.engine, env.service.voices, ServiceLimits(deadline_s=0.2), frontend_threads=1
    )
    port = free_port()
    extra = env.run(start_grpc_server(hasty, "127.0.0.1", port))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = cosyserve_v1_pb2_grpc.SpeechStub(channel)
            code, details, _ = status_of(stub.Synthesize(v1_request(min_tokens=400, max_tokens=400)))
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED and "deadline" in details
        env.wait_idle(hasty)
    finally:
        env.run(extra.stop(None))
        hasty.close()


def test_a_port_in_use_is_an_os_error(env: GrpcEnv) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(OSError, match="cannot listen for gRPC"):
            env.run(start_grpc_server(env.service, "127.0.0.1", taken.getsockname()[1]))


def test_committed_stubs_are_current(tmp_path: Path) -> None:
    protos = Path("cosyserve/server/grpc/protos")
    (tmp_path / protos).mkdir(parents=True)
    names = ["cosyvoice.proto", "cosyserve_v1.proto"]
    for name in names:
        (tmp_path / protos / name).write_bytes((REPO / "src" / protos / name).read_bytes())
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-I", str(tmp_path)]
        + [f"--{kind}_out={tmp_path}" for kind in ("python", "pyi", "grpc_python")]
        + [str(protos / name) for name in names],
        check=True,
        cwd=tmp_path,
    )
    generated = sorted(p.name for p in (tmp_path / protos).iterdir() if p.suffix in (".py", ".pyi"))
    assert len(generated) == 6
    for name in generated:
        assert (tmp_path / protos / name).read_bytes() == (REPO / "src" / protos / name).read_bytes(), name
