"""Primed flow stream caches per voice, so a stream's first chunk skips the voice prompt.

The states of a voice prompt's whole blocks are the same in every stream of that voice
(:meth:`Flow.prime_stream`); without this cache every stream's first chunk recomputes
them (the encoder and every Euler step over the prompt). :class:`FlowPromptCache` keeps
them for recently used voices and starts each stream from a fork
(:meth:`FlowStreamCache.fork`), evicting the least recently used voices beyond a memory
bound.
"""

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import Tensor

from cosyserve.models.flow.flow import Flow
from cosyserve.models.flow.stream_cache import FlowStreamCache


@dataclass
class FlowPromptCacheStats:
    """Counters since the cache was made (streams whose prompt has no voice-only block
    are not counted)."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0


class FlowPromptCache:
    """Primed stream caches of up to ``max_bytes`` bytes, least recently used voice first
    out. Not thread-safe: one per engine, used on the engine thread only."""

    def __init__(self, flow: Flow, max_bytes: int, whole: bool = False) -> None:
        """``whole``: prime every whole block of a prompt (``Flow.prime_stream``'s
        ``whole``): shorter first chunks, slightly different audio."""
        if max_bytes < 1:
            raise ValueError("a flow prompt cache needs a positive size")
        self.flow = flow
        self.max_bytes = max_bytes
        self.whole = whole
        self.stats = FlowPromptCacheStats()
        self._primed: OrderedDict[bytes, FlowStreamCache] = OrderedDict()
        self._nbytes = 0

    def __len__(self) -> int:
        """Voices held."""
        return len(self._primed)

    @property
    def nbytes(self) -> int:
        """Memory of the primed caches held."""
        return self._nbytes

    def stream_cache(
        self, prompt_token: Tensor, prompt_feat: Tensor, embedding: Tensor, compact: bool = False
    ) -> FlowStreamCache:
        """A cache for a new :meth:`Flow.stream` of this voice (batch of one), starting
        after its primed prefix (primed now on a miss). ``compact``: the stream's own
        positions are kept compact (:class:`FlowStreamCache`); the primed ones, shared by
        every stream of the voice, stay keys and values.

        The voice, on any device: ``prompt_token`` ``(P,)`` int, ``prompt_feat``
        ``(P_mel, 80)`` log-mel, ``embedding`` ``(spk_embed_dim,)``."""
        if self.flow.voice_prefix(prompt_token.shape[0], prompt_feat.shape[0], self.whole) == 0:
            return self.flow.new_stream_cache(compact)  # nothing to share: no key, no counts
        key = self._key(prompt_token, prompt_feat, embedding)
        primed = self._primed.get(key)
        if primed is not None:
            self.stats.hits += 1
            self._primed.move_to_end(key)
            return primed.fork(compact)
        self.stats.misses += 1
        device = self.flow.speaker_proj.weight.device
        token, feat, speaker = (t.to(device)[None] for t in (prompt_token, prompt_feat, embedding))
        primed = self.flow.prime_stream(token, feat, speaker, whole=self.whole)
        self._store(key, primed)
        return primed.fork(compact)

    def _store(self, key: bytes, primed: FlowStreamCache) -> None:
        size = primed.nbytes()
        if size > self.max_bytes:
            return  # would evict everything and still not fit
        while self._nbytes + size > self.max_bytes:
            _, evicted = self._primed.popitem(last=False)
            self._nbytes -= evicted.nbytes()
            self.stats.evictions += 1
        self._primed[key] = primed
        self._nbytes += size

    def _key(self, prompt_token: Tensor, prompt_feat: Tensor, embedding: Tensor) -> bytes:
        """A digest of the voice (every byte, shape and dtype of its prompt tokens, prompt
        mel and embedding) and of the flow's dtype and device, which its states depend on."""
        weight = self.flow.speaker_proj.weight
        digest = hashlib.blake2b(f"{weight.dtype} {weight.device}".encode(), digest_size=32)
        for tensor in (prompt_token, prompt_feat, embedding):
            digest.update(f"|{tuple(tensor.shape)} {tensor.dtype}|".encode())
            raw = tensor.detach().contiguous().flatten().view(torch.uint8).cpu()
            digest.update(raw.numpy().tobytes())
        return digest.digest()
