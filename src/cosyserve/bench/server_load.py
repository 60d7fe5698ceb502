"""``cosyserve bench server``: an HTTP load generator for a running speech server.

Each concurrency level runs ``requests`` requests with ``concurrency`` asyncio workers,
each sending its next request when the previous one ends (a closed loop). It drives either
the OpenAI route (``POST /v1/audio/speech``) or upstream CosyVoice's FastAPI routes
(``/inference_sft`` with a voice, ``/inference_zero_shot`` with a prompt recording), so
that cosyserve and upstream's own server can be compared on the same load.

Per request it times the first audio byte and the end; audio length comes from the
bytes (PCM and WAV are decoded) or, for compressed formats, from the forced token count
(25 tokens per second). Refused and failed requests are counted by status.
"""

import asyncio
import io
import struct
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

from cosyserve.bench.engine_bench import Percentiles

Api = Literal["openai", "upstream"]
TOKENS_PER_SECOND = 25
MODEL_SAMPLE_RATE = 24000  # CosyVoice 2's output rate
# Upstream's FastAPI server streams raw int16 mono PCM at the model's rate.
UPSTREAM_FORMAT = "pcm"


@dataclass(frozen=True)
class LoadOptions:
    """What to send. ``requests``: per level. ``voice``: a registered or built-in voice
    (upstream API: ``spk_id`` of ``/inference_sft``); without one, ``prompt_wav`` and
    ``prompt_text`` clone a voice (``/inference_zero_shot``; OpenAI API: not supported).
    ``tokens``: forced speech tokens per request (OpenAI API only; cosyserve extension).
    ``abort_fraction``: this share of requests disconnect after their first audio byte.
    ``sample_rate``: asked of the OpenAI route (None: the model's, 24 kHz); it is also how
    PCM bodies are measured."""

    url: str
    concurrency: tuple[int, ...] = (1, 4, 16)
    requests: int = 32
    stream: bool = False
    format: str = "wav"
    api: Api = "openai"
    voice: str | None = None
    tokens: int | None = None
    text: str = "Hello, this is a load test of the speech server."
    prompt_wav: bytes | None = field(default=None, repr=False)
    prompt_text: str = ""
    abort_fraction: float = 0.0
    timeout_s: float = 300.0
    sample_rate: int | None = None
    warm_connections: bool = True

    def __post_init__(self) -> None:
        if not self.concurrency or min(self.concurrency) < 1 or self.requests < 1:
            raise ValueError("concurrency levels and requests must be at least 1")
        if self.api == "openai" and self.voice is None:
            raise ValueError("the OpenAI API needs a voice")
        if self.api == "upstream" and self.voice is None and self.prompt_wav is None:
            raise ValueError("the upstream API needs a voice (spk_id) or a prompt recording")
        if self.api == "upstream" and self.tokens is not None:
            raise ValueError("forced token counts are an OpenAI-route extension")
        if self.api == "upstream" and self.sample_rate is not None:
            raise ValueError("upstream's routes return the model's rate only")
        if not 0.0 <= self.abort_fraction <= 1.0:
            raise ValueError("abort_fraction must be within 0-1")

    @property
    def audio_format(self) -> str:
        return UPSTREAM_FORMAT if self.api == "upstream" else self.format


@dataclass(frozen=True)
class RequestResult:
    """One request. ``outcome``: ``ok``, ``aborted`` (left on purpose), an HTTP status
    (``429``), ``timeout`` or ``transport``. ``first_byte_s``: to the first audio byte
    (None without audio); ``status_s``: to the response headers; ``audio_s``: audio
    received (None where it cannot be told)."""

    outcome: str
    status_s: float
    total_s: float
    first_byte_s: float | None = None
    audio_s: float | None = None


@dataclass(frozen=True)
class LevelReport:
    """One concurrency level. Percentiles are over completed requests (``ok``);
    ``refusal_s`` over 429 answers (time to the status). ``errors``: count by outcome,
    neither ``ok`` nor ``aborted``."""

    concurrency: int
    requests: int
    ok: int
    aborted: int
    errors: dict[str, int]
    wall_s: float
    requests_per_s: float
    audio_s_per_s: float | None
    first_byte_s: Percentiles | None
    total_s: Percentiles | None
    refusal_s: Percentiles | None
    max_refusal_s: float | None


@dataclass(frozen=True)
class ServerLoadReport:
    url: str
    api: str
    stream: bool
    format: str
    voice: str | None
    tokens: int | None
    requests: int
    levels: list[LevelReport]


def run_server_load(options: LoadOptions, on_done: Callable[[int], None] | None = None) -> ServerLoadReport:
    """Run every level in turn; ``on_done(level)`` after each request."""
    return asyncio.run(_run(options, on_done or (lambda _: None)))


async def _run(options: LoadOptions, on_done: Callable[[int], None]) -> ServerLoadReport:
    levels = []
    for concurrency in options.concurrency:
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        timeout = httpx.Timeout(options.timeout_s, connect=30.0)
        async with httpx.AsyncClient(base_url=options.url, timeout=timeout, limits=limits) as client:
            if options.warm_connections:  # time the server's answers, not TCP setup
                await asyncio.gather(*(client.get("/health") for _ in range(concurrency)))
            levels.append(await _level(client, options, concurrency, on_done))
    return ServerLoadReport(
        url=options.url,
        api=options.api,
        stream=options.stream,
        format=options.audio_format,
        voice=options.voice,
        tokens=options.tokens,
        requests=options.requests,
        levels=levels,
    )


async def _level(
    client: httpx.AsyncClient, options: LoadOptions, concurrency: int, on_done: Callable[[int], None]
) -> LevelReport:
    results: list[RequestResult] = []
    next_index = 0

    async def worker() -> None:
        nonlocal next_index
        while next_index < options.requests:
            index = next_index
            next_index += 1
            # Spread aborts evenly: request i aborts when the running share falls behind.
            abort = int((index + 1) * options.abort_fraction) > int(index * options.abort_fraction)
            results.append(await one_request(client, options, abort))
            on_done(concurrency)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return summarize(concurrency, results, time.perf_counter() - start)


def summarize(concurrency: int, results: list[RequestResult], wall_s: float) -> LevelReport:
    ok = [r for r in results if r.outcome == "ok"]
    refused = [r.status_s for r in results if r.outcome == "429"]
    errors = Counter(r.outcome for r in results if r.outcome not in ("ok", "aborted"))
    audio = [r.audio_s for r in ok]
    first = [r.first_byte_s for r in ok if r.first_byte_s is not None]
    return LevelReport(
        concurrency=concurrency,
        requests=len(results),
        ok=len(ok),
        aborted=sum(r.outcome == "aborted" for r in results),
        errors=dict(sorted(errors.items())),
        wall_s=wall_s,
        requests_per_s=len(ok) / wall_s if wall_s > 0 else 0.0,
        audio_s_per_s=(
            sum(a for a in audio if a is not None) / wall_s
            if ok and None not in audio and wall_s > 0
            else None
        ),
        first_byte_s=Percentiles.of(first) if first else None,
        total_s=Percentiles.of([r.total_s for r in ok]) if ok else None,
        refusal_s=Percentiles.of(refused) if refused else None,
        max_refusal_s=max(refused) if refused else None,
    )


async def one_request(client: httpx.AsyncClient, options: LoadOptions, abort: bool = False) -> RequestResult:
    """Send one request and read its answer (or leave after the first audio byte)."""
    method, path, kwargs = _request(options)
    start = time.perf_counter()
    status_s = 0.0
    try:
        async with client.stream(method, path, **kwargs) as response:
            status_s = time.perf_counter() - start
            if response.status_code != 200:
                await response.aread()
                return RequestResult(str(response.status_code), status_s, time.perf_counter() - start)
            first: float | None = None
            body = bytearray()
            async for piece in response.aiter_bytes():
                if piece and first is None:
                    first = time.perf_counter() - start
                    if abort:
                        return RequestResult("aborted", status_s, first, first)
                body += piece
    except httpx.TimeoutException:
        return RequestResult("timeout", status_s, time.perf_counter() - start)
    except httpx.TransportError:
        return RequestResult("transport", status_s, time.perf_counter() - start)
    total = time.perf_counter() - start
    return RequestResult("ok", status_s, total, first, _audio_seconds(bytes(body), options))


def _request(options: LoadOptions) -> tuple[str, str, dict[str, Any]]:
    if options.api == "openai":
        body: dict[str, Any] = {
            "model": "tts-1",
            "input": options.text,
            "voice": options.voice,
            "response_format": options.format,
            "stream": options.stream,
        }
        if options.tokens is not None:
            body |= {"min_tokens": options.tokens, "max_tokens": options.tokens}
        if options.sample_rate is not None:
            body["sample_rate"] = options.sample_rate
        return "POST", "/v1/audio/speech", {"json": body}
    if options.voice is not None:
        return "POST", "/inference_sft", {"data": {"tts_text": options.text, "spk_id": options.voice}}
    data = {"tts_text": options.text, "prompt_text": options.prompt_text}
    files = {"prompt_wav": ("prompt_wav", options.prompt_wav or b"", "application/octet-stream")}
    return "POST", "/inference_zero_shot", {"data": data, "files": files}


def _audio_seconds(body: bytes, options: LoadOptions) -> float | None:
    fmt = options.audio_format
    if fmt == "pcm":
        return len(body) / 2 / (options.sample_rate or MODEL_SAMPLE_RATE)
    if fmt == "wav":
        return wav_seconds(body)
    return None if options.tokens is None else options.tokens / TOKENS_PER_SECOND


def wav_seconds(data: bytes) -> float | None:
    """Seconds of a RIFF/WAVE body, from the bytes actually present after the ``data``
    chunk header (a streamed WAV declares a placeholder size); None if it is not WAV."""
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        return None
    stream = io.BytesIO(data[12:])
    frame_bytes = rate = 0
    while header := stream.read(8):
        if len(header) < 8:
            return None
        tag, size = header[:4], struct.unpack("<I", header[4:])[0]
        if tag == b"fmt ":
            fmt = stream.read(size)
            if len(fmt) < 16:
                return None
            channels, rate = struct.unpack("<HI", fmt[2:8])
            frame_bytes = channels * struct.unpack("<H", fmt[14:16])[0] // 8
            stream.seek(size % 2, io.SEEK_CUR)
        elif tag == b"data":
            if not frame_bytes or not rate:
                return None
            remaining = len(data) - 12 - stream.tell()
            return remaining / frame_bytes / rate
        else:
            stream.seek(size + size % 2, io.SEEK_CUR)
    return None
