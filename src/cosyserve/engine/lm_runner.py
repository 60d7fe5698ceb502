"""The LM side of a step: chunked prefill and one batched decode step for many requests."""

import torch

from cosyserve.engine.decode_graphs import DecodeGraphs
from cosyserve.engine.request import Phase, Request, SegmentState
from cosyserve.engine.stats import EngineStats
from cosyserve.errors import CosyserveError
from cosyserve.models.kv_cache import KVCache
from cosyserve.models.prefix_cache import PrefixCache, lm_input_ids
from cosyserve.models.sampling import LengthLimits, sample_tokens
from cosyserve.models.speech_lm import AnySpeechLM


class NumericalError(CosyserveError):
    """The model produced non-finite values for some requests of a batch."""

    code = "numerical_error"

    def __init__(self, message: str, request_ids: list[str]) -> None:
        super().__init__(message)
        self.request_ids = request_ids


class LMRunner:
    """Owns the KV cache (and the prefix cache, if any); runs prefill chunks and batched
    decode steps, replayed from ``decode_graphs`` when given."""

    def __init__(
        self,
        lm: AnySpeechLM,
        cache: KVCache,
        stats: EngineStats,
        prefix_cache: PrefixCache | None = None,
        decode_graphs: DecodeGraphs | None = None,
    ) -> None:
        self.lm = lm
        self.cache = cache
        self.stats = stats
        self.prefix_cache = prefix_cache
        self.decode_graphs = decode_graphs
        self._device = lm.speech_embedding.weight.device
        self._silent = frozenset(lm.cfg.silent_tokens)

    @torch.inference_mode()
    def start_segment(self, request: Request) -> None:
        """Prepare the LM input of the request's current segment in its (empty) slot, loading
        whatever start of it the prefix cache holds."""
        spec = request.spec
        seg = request.lm_state
        assert request.slot is not None
        text_ids = spec.lm_prefix_ids + seg.spec.text_ids
        text = torch.tensor(text_ids, dtype=torch.long, device=self._device)
        speech = torch.tensor(spec.lm_prompt_speech, dtype=torch.long, device=self._device)
        request.prefill_input = self.lm.prompt_embeddings(text, speech)  # (T, H)
        request.prefill_pos = 0
        if self.prefix_cache is not None:
            ids = lm_input_ids(text_ids, spec.lm_prompt_speech)
            # The last position is always computed: its output gives the first token.
            request.prefill_pos = self.prefix_cache.restore(ids, self.cache, request.slot, len(ids) - 1)
            request.prefill_ids = ids
        request.phase = Phase.PREFILL

    @torch.inference_mode()
    def prefill(self, request: Request, budget: int) -> int:
        """Feed up to ``budget`` positions of the pending LM input; when it is all in, keep
        it in the prefix cache and sample the segment's first token. Returns the positions
        fed. Raises :class:`NumericalError` if the model's output is not finite."""
        assert request.prefill_input is not None and request.slot is not None
        chunk = request.prefill_input[request.prefill_pos : request.prefill_pos + budget]
        with self.stats.timed("prefill"):
            log_probs = self.lm.prefill(chunk, request.slot, self.cache)
        self.stats.prefill_tokens += int(chunk.shape[0])
        request.prefill_pos += chunk.shape[0]
        if request.prefill_pos == request.prefill_input.shape[0]:
            request.prefill_input = None
            request.phase = Phase.DECODE
            if self._sample([request], log_probs[None]):
                raise NumericalError("non-finite LM output", [request.id])
            if self.prefix_cache is not None and request.prefill_ids is not None:
                self.prefix_cache.store(request.prefill_ids, self.cache, request.slot)
            request.prefill_ids = None
        return int(chunk.shape[0])

    @torch.inference_mode()
    def decode(self, requests: list[Request]) -> list[Request]:
        """One decode step for every request in ``requests`` (all in phase DECODE). Returns
        those whose LM output was not finite; they got no token and must be failed (their
        slot holds a position for this step, so they cannot simply go on)."""
        last = torch.tensor([r.lm_state.history[-1] for r in requests], dtype=torch.long, device=self._device)
        slots = [r.slot for r in requests if r.slot is not None]
        assert len(slots) == len(requests)
        with self.stats.timed("decode"):
            if self.decode_graphs is None:
                log_probs = self.lm.decode(last, slots, self.cache)
            else:
                log_probs = self.decode_graphs.decode(last, slots)
            failed = self._sample(requests, log_probs)
        self.stats.decode_steps += 1
        self.stats.decoded_tokens += len(requests) - len(failed)
        self.stats.last_decode_batch = len(requests)
        return failed

    def _sample(self, requests: list[Request], log_probs: torch.Tensor) -> list[Request]:
        """Sample the next token of each request whose row of ``log_probs`` (B, V) is
        usable; returns the others, untouched, so one bad row never costs the batch a step."""
        finite = (torch.isfinite(log_probs).any(-1) & ~torch.isnan(log_probs).any(-1)).tolist()
        good = [i for i, ok in enumerate(finite) if ok]
        failed = [r for r, ok in zip(requests, finite, strict=True) if not ok]
        if not good:
            return failed
        if failed:
            requests = [requests[i] for i in good]
            log_probs = log_probs[good]
        segs = [r.lm_state for r in requests]
        limits = [_limits(s) for s in segs]
        tokens = sample_tokens(
            log_probs,
            [s.history for s in segs],
            [r.lm_generator for r in requests],
            limits,
            self.lm.cfg.sampling,
            self.lm.cfg.fallback_bans_repeat,
        ).tolist()
        stops = set(self.lm.cfg.stop_token_ids)
        for seg, token, limit in zip(segs, tokens, limits, strict=True):
            if token in stops:
                seg.lm_done = True
                continue
            seg.keep_token(int(token), self._silent, self.lm.cfg.max_silent_run)
            if len(seg.history) >= limit.max_tokens:
                seg.lm_done = True
        return failed


def _limits(seg: SegmentState) -> LengthLimits:
    assert seg.limits is not None, "segments with given speech tokens never reach the LM"
    return seg.limits
