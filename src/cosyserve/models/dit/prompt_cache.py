"""Primed voice prompts for CosyVoice 3 streams: a voice's first prompt frames are computed
once and every later stream of the voice starts after them.

A stream's first push otherwise runs the DiT over every frame of the voice prompt (3 s: 150
frames) before its own. The frames of the complete attention chunks before the first
frame whose token features see the generated tokens (the last ``pre_lookahead_len`` prompt
tokens look ahead to them) are the same in every stream of the voice
(:func:`~cosyserve.models.dit.stream.primed_prompt_frames`): a 3 s prompt has 100 such
frames, and its first push then computes 50 prompt frames besides its own, with the same
output. *Whole* priming takes every complete chunk of the prompt, its last tokens looking
ahead at zeros as if the prompt ended there (a deviation, largest in the first chunk): a
3 s prompt's first push then computes its own frames only.

Memory: each voice holds its primed frames' keys and values (3.6 MB a frame in float32 on
the released model: 360 MB for a 3 s prompt, 540 MB primed whole; half in float16), bounded
by the cache's bytes, least recently used voice out. Streams read them without a copy
(:meth:`~cosyserve.models.dit.cache.StepCache.fork`); a voice evicted while its streams
run is freed when they end.
"""

import torch
from torch import Tensor

from cosyserve.models.dit.cache import StepCache
from cosyserve.models.dit.flow3 import Flow3
from cosyserve.models.dit.stream import Flow3Stream, prime_prompt, primed_prompt_frames
from cosyserve.models.flow.prompt_cache import PrimedPromptCache


def _steps_bytes(caches: list[StepCache]) -> int:
    return sum(cache.nbytes() for cache in caches)


class Flow3PromptCache(PrimedPromptCache[list[StepCache]]):
    """Primed step caches of CosyVoice 3 voice prompts (see
    :class:`~cosyserve.models.flow.prompt_cache.PrimedPromptCache`)."""

    def __init__(
        self,
        flow: Flow3,
        max_bytes: int,
        whole: bool = False,
        cache_dtype: torch.dtype | None = None,
        primed_dtype: torch.dtype | None = None,
    ) -> None:
        """``whole``: prime every complete attention chunk of a prompt (a deviation);
        ``cache_dtype``: what streams hold their own keys and values in, ``primed_dtype``:
        what the primed ones are held in (None: the flow's dtype)."""
        super().__init__(max_bytes, flow.speaker_proj.weight, _steps_bytes)
        self.flow = flow
        self.whole = whole
        self.cache_dtype = cache_dtype
        self.primed_dtype = primed_dtype

    def primed_frames(self, prompt_tokens: int, prompt_frames: int) -> int:
        """The frames a stream of a prompt this long reads primed (see
        :func:`~cosyserve.models.dit.stream.primed_prompt_frames`)."""
        return primed_prompt_frames(self.flow, prompt_tokens, prompt_frames, self.whole)

    def stream(
        self, prompt_token: Tensor, prompt_feat: Tensor, embedding: Tensor, frames: int = 0
    ) -> Flow3Stream:
        """A new :class:`Flow3Stream` of this voice starting after its primed frames
        (primed now on a miss; a prompt without a primable chunk is neither primed nor
        counted). Arguments on the flow's device, as for :class:`Flow3Stream`."""
        prefix = self.primed_frames(prompt_token.shape[1], prompt_feat.shape[1])
        voice = (self.flow, prompt_token, prompt_feat, embedding, frames)
        if prefix == 0:
            return Flow3Stream(*voice, cache_dtype=self.cache_dtype)

        def prime() -> list[StepCache]:
            return prime_prompt(self.flow, prompt_token, prompt_feat, embedding, prefix, self.primed_dtype)

        primed = self.primed(prompt_token, prompt_feat, embedding, prime)
        return Flow3Stream(*voice, primed, self.cache_dtype)
