"""The token2wav side of a step: flow (tokens -> mel) and HiFT (mel -> waveform) for the
ready chunks of several requests, batched."""

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from cosyserve.engine.chunking import Chunk
from cosyserve.engine.config import FLOW_CACHE_MODES, FlowCacheMode
from cosyserve.engine.request import Request, SegmentState
from cosyserve.engine.stats import EngineStats
from cosyserve.models.flow.flow import Flow
from cosyserve.models.flow.prompt_cache import FlowPromptCache
from cosyserve.models.flow.rows import FlowRow, infer_rows, stream_rows
from cosyserve.models.flow.stream_cache import FlowStreamCache
from cosyserve.models.hift.generator import HiFTGenerator
from cosyserve.models.hift.source import Excitation
from cosyserve.models.hift.stream import StreamOptions

logger = logging.getLogger(__name__)

_In = TypeVar("_In")
_Out = TypeVar("_Out")


@dataclass(frozen=True, eq=False)
class ChunkWork:
    """One ready chunk of one request's segment."""

    request: Request
    seg: SegmentState
    chunk: Chunk


@dataclass(frozen=True, eq=False)
class _Vocoding:
    """One chunk's HiFT input: ``mel`` ``(1, 80, T)`` (streaming: after the cached frames),
    ``cache_source`` ``(1, 1, S)`` or None, and its excitation, drawn before the batched
    call from the request's own generator so that a retry alone reuses the same draws."""

    mel: Tensor
    cache_source: Tensor | None
    excitation: Excitation


class Token2Wav:
    """Runs the ready chunks of several requests through the flow and the vocoder.

    Chunks that can share a call do: the flow takes non-incremental chunks of any lengths
    together (ragged rows), incremental streaming chunks whose caches hold the same number
    of tokens together, and HiFT chunks of equal mel length together. Every request's
    output is what it gets alone (float rounding aside). A failed batched call is retried
    one chunk at a time, so only the chunk that fails alone fails.

    Streaming chunks follow upstream CosyVoice2Model.token2wav: intermediate chunks use
    block-causal attention with lookahead, the final chunk full attention over every token;
    the vocoder's caches live in the segment's state.

    ``flow_cache`` says how streaming chunks reach the flow (``docs/streaming.md``, "The flow
    without quadratic recompute"):
    ``"exact"`` recomputes prompt + all tokens for every chunk, as upstream;
    ``"cached"`` computes intermediate chunks incrementally from the segment's
    :class:`~cosyserve.models.flow.stream_cache.FlowStreamCache` (same output) and the final
    chunk as upstream; ``"incremental"`` computes the final chunk from the cache too, with
    block-causal attention: the cheapest, but its frames differ from upstream's. A stream
    whose first chunk is its last one runs as upstream in every mode. ``prompt_cache``: the
    primed voice-prompt states incremental streams start from (None: from nothing). The engine passes
    :attr:`EngineConfig.flow_cache <cosyserve.engine.config.EngineConfig>`; the default
    here is upstream's behaviour.
    """

    def __init__(
        self,
        flow: Flow,
        hift: HiFTGenerator,
        stats: EngineStats,
        flow_cache: FlowCacheMode = "exact",
        prompt_cache: FlowPromptCache | None = None,
        cache_budget: int = 0,
        reserved_bytes: Callable[[], int] | None = None,
        compact_caches: bool = False,
        stream_rows: int = 0,
        cache_dtype: torch.dtype | None = None,
    ) -> None:
        if flow_cache not in FLOW_CACHE_MODES:
            raise ValueError(f"flow_cache must be one of {FLOW_CACHE_MODES}, not {flow_cache!r}")
        if StreamOptions().samples_per_frame != hift.cfg.upsample_factor:
            raise ValueError(
                f"stream options assume {StreamOptions().samples_per_frame} samples per frame, "
                f"the vocoder makes {hift.cfg.upsample_factor}"
            )
        self.flow = flow
        self.hift = hift
        self.stats = stats
        self.flow_cache = flow_cache
        self.prompt_cache = prompt_cache
        if cache_budget < 0 or (cache_budget and reserved_bytes is None):
            raise ValueError("a stream cache budget needs to be positive and to know what is reserved")
        self.cache_budget = cache_budget
        self.reserved_bytes = reserved_bytes
        self.compact_caches = compact_caches
        self.cache_dtype = cache_dtype
        if stream_rows < 0:
            raise ValueError("stream_rows must not be negative")
        self.stream_rows = stream_rows

    @torch.inference_mode()
    def run(self, work: Sequence[ChunkWork]) -> list[np.ndarray | Exception]:
        """Per chunk, the samples (float32, mono) it adds to its request's audio, or the
        error that failed it. A streaming chunk's segment state moves on only if it succeeds."""
        with self.stats.timed("flow"):
            mels = self._flow(work)
        with self.stats.timed("hift"):
            return self._vocode(work, mels)

    # -- flow ---------------------------------------------------------------------------------

    def _flow(self, work: Sequence[ChunkWork]) -> list[Tensor | Exception]:
        """Per chunk, its new mel frames ``(1, 80, T)`` float32, or the error."""
        groups: dict[tuple[object, ...], list[int]] = {}
        results: list[Tensor | Exception] = [RuntimeError("not run")] * len(work)
        for i, item in enumerate(work):
            seg, chunk = item.seg, item.chunk
            if self._incremental(item):
                if seg.flow_cache is None:
                    try:  # priming a voice's prompt states can fail; only this request fails then
                        seg.flow_cache = self._new_flow_cache(item)
                    except torch.AcceleratorError:
                        raise
                    except Exception as exc:
                        results[i] = exc
                        continue
                key: tuple[object, ...] = ("incremental", seg.flow_cache.tokens, chunk.finalize)
            else:
                key = ("full", item.request.spec.stream and not chunk.finalize, chunk.finalize)
            groups.setdefault(key, []).append(i)
        for (kind, *_), members in groups.items():
            call = self._flow_incremental if kind == "incremental" else self._flow_full
            size = self.stream_rows if kind == "incremental" and self.stream_rows else len(members)
            for start in range(0, len(members), size):
                part = members[start : start + size]
                _batched("flow", call, [work[i] for i in part], part, results)
        for item, mel in zip(work, results, strict=True):
            if item.chunk.finalize and isinstance(mel, Tensor):
                item.seg.flow_cache = None  # free the cached keys and values now, not with the request
                item.seg.flow_reserved = 0
        return results

    def _new_flow_cache(self, item: ChunkWork) -> FlowStreamCache:
        """The flow cache ``item``'s streamed segment starts from: a fork of its voice's
        primed prompt states when ``prompt_cache`` is set, else an empty one. On CPU it is
        reserved for the longest the segment can get: unwritten pages cost no memory there,
        while a CUDA allocation is memory at once, and regrowing on a GPU is cheap."""
        spec = item.request.spec
        if self.prompt_cache is None:
            cache = self.flow.new_stream_cache(self.compact_caches, self.cache_dtype)
        else:
            voice = (spec.flow_prompt_tokens, spec.flow_prompt_mel, spec.embedding)
            cache = self.prompt_cache.stream_cache(*voice, self.compact_caches, self.cache_dtype)
        if self._reserves_caches:
            cache.reserve(stream_tokens(item), self.flow.token_mel_ratio)
        return cache

    def _flow_full(self, work: Sequence[ChunkWork]) -> list[Tensor]:
        """Chunks recomputed over prompt + every token (non-streaming, exact streaming)."""
        first = work[0]
        streaming = first.request.spec.stream and not first.chunk.finalize
        mels = infer_rows(
            self.flow, [self._row(w) for w in work], streaming=streaming, finalize=first.chunk.finalize
        )
        self._count_flow(len(work))
        return [mel[None] for mel in mels]

    def _flow_incremental(self, work: Sequence[ChunkWork]) -> list[Tensor]:
        """Streaming chunks from their segments' flow caches (in step with each other)."""
        caches = []
        for w in work:
            assert w.seg.flow_cache is not None
            caches.append(w.seg.flow_cache)
        rows = [self._row(w) for w in work]
        mels = stream_rows(self.flow, caches, rows, finalize=work[0].chunk.finalize)
        self._count_flow(len(work))
        return [mel[None] for mel in mels]

    def _row(self, item: ChunkWork) -> FlowRow:
        spec, device = item.request.spec, self.flow.speaker_proj.weight.device
        return FlowRow(
            token=torch.tensor(item.seg.tokens[: item.chunk.token_end], dtype=torch.long, device=device),
            prompt_token=spec.flow_prompt_tokens.to(device),
            prompt_feat=spec.flow_prompt_mel.to(device),
            embedding=spec.embedding.to(device),
            offset=item.chunk.offset,
        )

    def _count_flow(self, rows: int) -> None:
        self.stats.flow_calls += 1
        self.stats.flow_rows += rows

    def _incremental(self, item: ChunkWork) -> bool:
        seg, chunk = item.seg, item.chunk
        if not item.request.spec.stream or self.flow_cache == "exact" or seg.flow_exact:
            return False
        if not chunk.finalize:
            return seg.flow_cache is not None or self._reserve(item)
        return self.flow_cache == "incremental" and seg.flow_cache is not None

    def _reserve(self, item: ChunkWork) -> bool:
        """Whether a new stream cache for ``item``'s segment fits ``cache_budget`` beside the
        others' reservations. If so, it is reserved for the longest the segment can get;
        if not, the segment recomputes every chunk as in the exact mode (upstream's output,
        more compute, no cache)."""
        if not self.cache_budget:
            return True
        need = self.flow.stream_cache_bytes(stream_tokens(item), self.compact_caches, self.cache_dtype)
        if not self._reserves_caches:
            need = 3 * need // 2  # the growth slack of unreserved buffers
        assert self.reserved_bytes is not None  # checked with the budget
        return reserve_stream_cache(item, need, self.cache_budget - self.reserved_bytes(), self.stats)

    @property
    def _reserves_caches(self) -> bool:
        return self.flow.speaker_proj.weight.device.type == "cpu"

    # -- HiFT ---------------------------------------------------------------------------------

    def _vocode(
        self, work: Sequence[ChunkWork], mels: list[Tensor | Exception]
    ) -> list[np.ndarray | Exception]:
        results: list[np.ndarray | Exception] = [RuntimeError("not run")] * len(work)
        inputs: dict[int, _Vocoding] = {}
        groups: dict[tuple[int, bool], list[int]] = {}
        for i, (item, mel) in enumerate(zip(work, mels, strict=True)):
            if isinstance(mel, Exception):
                results[i] = mel
                continue
            try:
                inputs[i] = self._prepare(item, mel)
            except Exception as exc:
                results[i] = exc
                continue
            groups.setdefault((inputs[i].mel.shape[2], inputs[i].cache_source is None), []).append(i)
        outputs: list[tuple[Tensor, Tensor] | Exception] = [RuntimeError("not run")] * len(work)
        for members in groups.values():
            _batched("hift", self._hift, [inputs[i] for i in members], members, outputs)
        for i, out in enumerate(outputs):
            if i in inputs:
                results[i] = out if isinstance(out, Exception) else self._commit(work[i], inputs[i], *out)
        return results

    def _prepare(self, item: ChunkWork, mel: Tensor) -> _Vocoding:
        spec, cache_source = item.request.spec, None
        if spec.stream:
            mel, cache_source = item.seg.hift.prepare(mel)
        elif spec.speed != 1.0:
            mel = F.interpolate(mel, size=int(mel.shape[2] / spec.speed), mode="linear")
        cfg = self.hift.cfg
        samples = mel.shape[2] * cfg.upsample_factor
        excitation = Excitation.draw(1, cfg.nb_harmonics + 1, samples, item.request.vocoder_generator)
        return _Vocoding(mel, cache_source, excitation)

    def _hift(self, inputs: Sequence[_Vocoding]) -> list[tuple[Tensor, Tensor]]:
        """Chunks of equal mel length (and all with or all without a cached source)."""
        mel = torch.cat([v.mel for v in inputs])  # (B, 80, T)
        sources = [v.cache_source for v in inputs if v.cache_source is not None]
        cache_source = torch.cat(sources) if sources else None  # (B, 1, S)
        excitation = Excitation(noise=torch.cat([v.excitation.noise for v in inputs]))
        wave, source = self.hift.inference(mel, cache_source, excitation=excitation)  # (B, L), (B, 1, L)
        self.stats.hift_calls += 1
        self.stats.hift_rows += len(inputs)
        return [(wave[b : b + 1], source[b : b + 1]) for b in range(len(inputs))]

    def _commit(
        self, item: ChunkWork, vocoding: _Vocoding, wave: Tensor, source: Tensor
    ) -> np.ndarray | Exception:
        try:
            if item.request.spec.stream:
                wave = item.seg.hift.commit(vocoding.mel, wave, source, finalize=item.chunk.finalize)
        except Exception as exc:
            return exc
        audio: np.ndarray = wave[0].float().cpu().numpy()
        self.stats.audio_samples += int(audio.size)
        return audio


def reserve_stream_cache(item: ChunkWork, need: int, room: int, stats: EngineStats) -> bool:
    """Reserve ``need`` bytes for ``item``'s segment's flow stream cache if ``room`` has
    them; if not, the segment recomputes every chunk as ``"exact"`` does (upstream's
    output, more compute, no cache), and the log says so."""
    seg = item.seg
    if need > room:
        seg.flow_exact = True
        stats.flow_cache_refusals += 1
        logger.info(
            "request %s: its flow stream cache (%d MiB) does not fit the budget; recomputing each chunk",
            item.request.spec.log_id or item.request.id,
            need >> 20,
        )
        return False
    seg.flow_reserved = need
    return True


def stream_tokens(item: ChunkWork) -> int:
    """The most tokens ``item``'s segment's flow cache can hold: the voice prompt's and
    the segment's longest output."""
    seg = item.seg
    longest = seg.limits.max_tokens if seg.limits is not None else len(seg.tokens)
    return int(item.request.spec.flow_prompt_tokens.numel()) + longest


def run_each(call: Callable[[_In], _Out], inputs: Sequence[_In]) -> list[_Out | Exception]:
    """``call`` on each input alone; an input's error is its own result. A broken device
    (``torch.AcceleratorError``) stops the engine instead."""
    results: list[_Out | Exception] = []
    for item in inputs:
        try:
            results.append(call(item))
        except torch.AcceleratorError:
            raise
        except Exception as exc:
            results.append(exc)
    return results


def _batched(
    stage: str,
    call: Callable[[list[_In]], list[_Out]],
    inputs: list[_In],
    indices: list[int],
    results: list[_Out | Exception],
) -> None:
    """``results[indices[k]] = call(inputs)[k]``; if the batched call fails, each input
    again alone, so that only an input that fails alone gets its error. A broken device
    (``torch.AcceleratorError``) is not retried: it stops the engine."""
    try:
        outputs: list[_Out | Exception] = list(call(inputs))
    except torch.AcceleratorError:
        raise
    except Exception as exc:
        if len(inputs) == 1:
            outputs = [exc]
        else:
            logger.exception("batched %s of %d chunks failed; retrying one by one", stage, len(inputs))
            outputs = []
            for item in inputs:
                try:
                    outputs.append(call([item])[0])
                except torch.AcceleratorError:
                    raise
                except Exception as alone:
                    outputs.append(alone)
    for i, out in zip(indices, outputs, strict=True):
        results[i] = out
