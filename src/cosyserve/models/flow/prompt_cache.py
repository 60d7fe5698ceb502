"""Primed flow stream caches per voice, so a stream's first chunk skips the voice prompt.

The states of a voice prompt's whole blocks are the same in every stream of that voice
(:meth:`Flow.prime_stream`); without this cache every stream's first chunk recomputes
them (the encoder and every Euler step over the prompt). :class:`FlowPromptCache` keeps
them for recently used voices and starts each stream from a fork
(:meth:`FlowStreamCache.fork`), evicting the least recently used voices beyond a memory
bound. :class:`PrimedPromptCache`, the keyed, bounded store, serves CosyVoice 3's flow too
(:class:`cosyserve.models.dit.prompt_cache.Flow3PromptCache`).
"""

import hashlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch
from torch import Tensor

from cosyserve.models.flow.flow import Flow
from cosyserve.models.flow.stream_cache import FlowStreamCache

Primed = TypeVar("Primed")


@dataclass
class FlowPromptCacheStats:
    """Counters since the cache was made (streams whose prompt has no voice-only block
    are not counted)."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0


class PrimedPromptCache(Generic[Primed]):
    """Primed states by voice, up to ``max_bytes`` bytes, least recently used voice first
    out. Not thread-safe: one per engine, used on the engine thread only.

    ``weight``: a parameter of the model the states come from (its dtype and device are in
    the key); ``size``: the bytes a primed state holds."""

    def __init__(self, max_bytes: int, weight: Tensor, size: Callable[[Primed], int]) -> None:
        if max_bytes < 1:
            raise ValueError("a flow prompt cache needs a positive size")
        self.max_bytes = max_bytes
        self.stats = FlowPromptCacheStats()
        self._weight = weight
        self._size = size
        self._primed: OrderedDict[bytes, tuple[Primed, int]] = OrderedDict()
        self._nbytes = 0

    def __len__(self) -> int:
        """Voices held."""
        return len(self._primed)

    @property
    def nbytes(self) -> int:
        """Memory of the primed states held."""
        return self._nbytes

    def primed(
        self, prompt_token: Tensor, prompt_feat: Tensor, embedding: Tensor, prime: Callable[[], Primed]
    ) -> Primed:
        """The voice's primed state: the one held (a hit), or ``prime()``'s, kept if it
        fits (a miss). Callers must not change it: every stream of the voice shares it."""
        key = self._key(prompt_token, prompt_feat, embedding)
        held = self._primed.get(key)
        if held is not None:
            self.stats.hits += 1
            self._primed.move_to_end(key)
            return held[0]
        self.stats.misses += 1
        state = prime()
        self._store(key, state)
        return state

    def _store(self, key: bytes, primed: Primed) -> None:
        size = self._size(primed)
        if size > self.max_bytes:
            return  # would evict everything and still not fit
        while self._nbytes + size > self.max_bytes:
            _, (_, evicted) = self._primed.popitem(last=False)
            self._nbytes -= evicted
            self.stats.evictions += 1
        self._primed[key] = (primed, size)
        self._nbytes += size

    def _key(self, prompt_token: Tensor, prompt_feat: Tensor, embedding: Tensor) -> bytes:
        """A digest of the voice (every byte, shape and dtype of its prompt tokens, prompt
        mel and embedding) and of the model's dtype and device, which its states depend on."""
        weight = self._weight
        digest = hashlib.blake2b(f"{weight.dtype} {weight.device}".encode(), digest_size=32)
        for tensor in (prompt_token, prompt_feat, embedding):
            digest.update(f"|{tuple(tensor.shape)} {tensor.dtype}|".encode())
            raw = tensor.detach().contiguous().flatten().view(torch.uint8).cpu()
            digest.update(raw.numpy().tobytes())
        return digest.digest()


class FlowPromptCache(PrimedPromptCache[FlowStreamCache]):
    """Primed stream caches of CosyVoice 2's flow (see :class:`PrimedPromptCache`)."""

    def __init__(self, flow: Flow, max_bytes: int, whole: bool = False) -> None:
        """``whole``: prime every whole block of a prompt (``Flow.prime_stream``'s
        ``whole``): shorter first chunks, slightly different audio."""
        super().__init__(max_bytes, flow.speaker_proj.weight, FlowStreamCache.nbytes)
        self.flow = flow
        self.whole = whole

    def stream_cache(
        self,
        prompt_token: Tensor,
        prompt_feat: Tensor,
        embedding: Tensor,
        compact: bool = False,
        dtype: torch.dtype | None = None,
    ) -> FlowStreamCache:
        """A cache for a new :meth:`Flow.stream` of this voice (batch of one), starting
        after its primed prefix (primed now on a miss). ``compact``, ``dtype``: how the
        stream's own positions are kept (:class:`FlowStreamCache`); the primed ones, shared
        by every stream of the voice, stay keys and values as computed.

        The voice, on any device: ``prompt_token`` ``(P,)`` int, ``prompt_feat``
        ``(P_mel, 80)`` log-mel, ``embedding`` ``(spk_embed_dim,)``."""
        if self.flow.voice_prefix(prompt_token.shape[0], prompt_feat.shape[0], self.whole) == 0:
            return self.flow.new_stream_cache(compact, dtype)  # nothing to share: no key, no counts

        def prime() -> FlowStreamCache:
            device = self.flow.speaker_proj.weight.device
            token, feat, speaker = (t.to(device)[None] for t in (prompt_token, prompt_feat, embedding))
            return self.flow.prime_stream(token, feat, speaker, whole=self.whole)

        return self.primed(prompt_token, prompt_feat, embedding, prime).fork(compact, dtype)
