"""Incremental streaming through the CosyVoice 3 flow: each push runs the DiT on the frames
after the last complete attention chunk only, attending to cached keys/values of the
frames before.

Why the cached frames are final: a frame's token features (``mu``) depend on its token,
the two before and the ``pre_lookahead_len`` after (the pre-look-ahead convolutions). While
streaming those later tokens are the real look-ahead tokens, so ``mu`` of every frame a
push computes is what any later call computes too (only an utterance's very last frames,
computed with zeros after them at ``finalize``, differ, and nothing follows them). The
noise of frame ``i`` is fixed, the positional convolutions are causal and attention is
chunk-causal: so at every Euler step the state of a frame in a complete chunk depends on
earlier frames only, and never changes. The frames of the last, incomplete chunk do change
when more frames join their chunk: a push recomputes them (it returns only frames not
returned before, as upstream's ``token_offset`` slicing does).

A voice prompt's first frames are the same in every stream of the voice: a stream may
start from them primed (:func:`prime_prompt`, :func:`primed_prompt_frames`, kept by
:class:`~cosyserve.models.dit.prompt_cache.Flow3PromptCache`), so that its first push
computes only the frames after them, and reads their keys and values from the shared
primed caches instead of holding a copy.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from cosyserve.models.dit.cache import StepCache
from cosyserve.models.dit.flow3 import Flow3
from cosyserve.models.dit.stacked import StackedStepCache
from cosyserve.models.int8_rows import row_bytes


@dataclass(frozen=True, eq=False)
class PendingPush:
    """A push's DiT inputs: ``mu``, ``cond`` ``(1, 80, T)`` of the frames after the cached
    ones; the stream's generated ``tokens`` ``(1, N)`` once pushed; ``final``: no
    look-ahead, the stream ends."""

    mu: Tensor
    cond: Tensor
    tokens: Tensor
    final: bool


class Flow3Stream:
    """One utterance's incremental flow state.

    Equivalent, push by push, to upstream's ``token2wav`` calls
    ``flow.inference(all tokens so far + look-ahead, streaming=True, finalize=False)`` with
    the mel kept after the frames already returned. The final call is :meth:`finish`.
    """

    def __init__(
        self,
        flow: Flow3,
        prompt_token: Tensor,
        prompt_feat: Tensor,
        embedding: Tensor,
        frames: int = 0,
        primed: Sequence[StepCache] | None = None,
        cache_dtype: torch.dtype | None = None,
    ) -> None:
        """``prompt_token``: ``(1, P)``; ``prompt_feat``: ``(1, F, 80)``; ``embedding``:
        ``(1, spk_embed_dim)``; ``frames``: the most frames (prompt included) the stream
        is expected to reach, which its caches are made for at once (0: grown as needed).
        On a CPU the pages of unreached frames are never written and cost no memory.
        ``primed``: this voice's :func:`prime_prompt` caches, which the stream reads its
        first frames from (the first push then starts after them), or None.
        ``cache_dtype``: what the stream's own keys and values are held in (None: the
        flow's dtype; see :mod:`cosyserve.models.dit.cache`)."""
        self.flow = flow
        dtype = next(flow.parameters()).dtype
        self.prompt_token = prompt_token
        self.prompt_feat = prompt_feat.to(dtype)
        self.embedding = embedding.to(dtype)
        self.tokens = prompt_token[:, :0]  # generated tokens with frames so far
        with torch.inference_mode():
            self.spks = flow.speaker(self.embedding)  # (1, 80)
        if primed is None:
            steps = flow.cfg.cfm.n_timesteps
            self.caches = [StepCache(flow.cfg.dit.depth, frames, cache_dtype) for _ in range(steps)]
        else:
            if len(primed) != flow.cfg.cfm.n_timesteps or primed[0].length > prompt_feat.shape[1]:
                raise ValueError("primed caches of another flow or prompt")
            self.caches = [cache.fork(frames, cache_dtype) for cache in primed]
        self.returned = prompt_feat.shape[1]  # frames returned so far, the prompt's included
        self.finished = False

    @property
    def cached_frames(self) -> int:
        """Frames (prompt included) whose keys/values are cached: whole attention chunks."""
        return self.caches[0].length

    def pending_frames(self, tokens: Tensor) -> int:
        """How many frames a push of ``tokens`` ``(1, n)`` runs the DiT over: those after
        the cached ones up to the end of ``tokens``."""
        count = self.prompt_token.shape[1] + self.tokens.shape[1] + tokens.shape[1]
        return count * self.flow.cfg.token_mel_ratio - self.cached_frames

    @torch.inference_mode()
    def push(self, tokens: Tensor, lookahead: Tensor | None) -> Tensor:
        """Append ``tokens`` ``(1, n)``, which look ahead to ``lookahead`` ``(1,
        pre_lookahead_len)`` (the next tokens), or to zeros when None (the utterance ends
        here, chunk-causal to the last frame). Returns the new mel ``(1, 80, T)`` float32:
        the frames after those returned before, up to the end of ``tokens``."""
        pending = self.prepare(tokens, lookahead)
        # (1, 80, end - start): the frames after the cached ones.
        mel: Tensor = self.flow.cfm(pending.mu, self.spks, pending.cond, True, self.caches)
        return self.advance(pending, mel)

    def prepare(self, tokens: Tensor, lookahead: Tensor | None) -> "PendingPush":
        """:meth:`push`'s DiT inputs; :meth:`advance` takes the DiT's output."""
        if self.finished:
            raise RuntimeError("the stream is finished")
        if lookahead is not None and lookahead.shape[1] != self.flow.cfg.pre_lookahead_len:
            raise ValueError(
                f"{lookahead.shape[1]} look-ahead tokens, need {self.flow.cfg.pre_lookahead_len}"
            )
        generated = torch.cat([self.tokens, tokens], dim=1)
        mu = self.flow.token_features(torch.cat([self.prompt_token, generated], dim=1), lookahead)
        end, start = mu.shape[2], self.cached_frames
        cond = self.flow.conditions(self.prompt_feat, end)[:, :, start:]
        return PendingPush(mu[:, :, start:], cond, generated, lookahead is None)

    def advance(self, pending: "PendingPush", mel: Tensor) -> Tensor:
        """Commit the frames of ``pending``'s push whose chunks are complete, given the DiT's
        ``mel`` ``(1, 80, T)`` of its frames; returns those not returned before."""
        start = self.cached_frames
        end = start + mel.shape[2]
        if pending.final:
            self.finished = True
            committed = 0
        else:
            chunk = self.flow.cfg.dit.static_chunk_size
            committed = end - end % chunk - start
        for cache in self.caches:
            cache.commit(committed)
        new = mel[:, :, self.returned - start :]
        self.tokens, self.returned = pending.tokens, end
        return new

    @torch.inference_mode()
    def finish(self, tokens: Tensor) -> Tensor:
        """The last call as upstream's ``CosyVoice3Model.tts`` makes it: append the last
        ``tokens`` ``(1, n)`` and run the whole utterance again without streaming (full
        attention, no look-ahead), so no cache helps. Returns the mel ``(1, 80, T)`` of
        the frames not returned before. (:meth:`push` with ``lookahead=None`` finishes
        chunk-causally and incrementally instead.)"""
        if self.finished:
            raise RuntimeError("the stream is finished")
        self.finished = True
        self.tokens = torch.cat([self.tokens, tokens], dim=1)
        mel: Tensor = self.flow.inference(
            self.tokens, self.prompt_token, self.prompt_feat, self.embedding, False, True
        )
        start = self.returned - self.prompt_feat.shape[1]
        self.returned = self.prompt_feat.shape[1] + mel.shape[2]
        return mel[:, :, start:]


@torch.inference_mode()
def push_streams(
    streams: Sequence[Flow3Stream], tokens: Sequence[Tensor], lookaheads: Sequence[Tensor | None]
) -> list[Tensor]:
    """Each stream's :meth:`Flow3Stream.push` of its ``tokens`` and ``lookaheads``, from one
    DiT pass over them all (:mod:`cosyserve.models.dit.stacked`): the same output up to
    float rounding. The streams must be of one flow and in lockstep: equally many cached
    frames, equally many new ones. If the pass fails no stream has changed."""
    if not streams or not len(streams) == len(tokens) == len(lookaheads):
        raise ValueError(f"{len(tokens)} pushes for {len(streams)} streams")
    flow = streams[0].flow
    frames = {s.pending_frames(t) for s, t in zip(streams, tokens, strict=True)}
    if any(s.flow is not flow for s in streams) or len(frames) != 1:
        raise ValueError("batched pushes need streams of one flow with equally many new frames")
    pending = [s.prepare(t, a) for s, t, a in zip(streams, tokens, lookaheads, strict=True)]
    caches = [StackedStepCache([s.caches[i] for s in streams]) for i in range(len(streams[0].caches))]
    mu, cond = torch.cat([p.mu for p in pending]), torch.cat([p.cond for p in pending])
    spks = torch.cat([s.spks for s in streams])
    mel: Tensor = flow.cfm(mu, spks, cond, True, caches)  # (S, 80, T)
    return [s.advance(p, mel[b : b + 1]) for b, (s, p) in enumerate(zip(streams, pending, strict=True))]


def primed_prompt_frames(flow: Flow3, prompt_tokens: int, prompt_frames: int, whole: bool = False) -> int:
    """How many of a voice prompt's frames a stream may start from primed: those of the
    complete attention chunks before the first frame whose token features see past the
    prompt (the last ``pre_lookahead_len`` prompt tokens look ahead to the generated ones)
    or, ``whole``, every complete chunk of the prompt (its look-ahead past the end read as
    zeros: a deviation). At most the ``prompt_frames`` frames of the prompt mel."""
    cfg = flow.cfg
    tokens = prompt_tokens if whole else max(0, prompt_tokens - cfg.pre_lookahead_len)
    frames = min(tokens * cfg.token_mel_ratio, prompt_frames)
    return frames - frames % cfg.dit.static_chunk_size


@torch.inference_mode()
def prime_prompt(
    flow: Flow3,
    prompt_token: Tensor,
    prompt_feat: Tensor,
    embedding: Tensor,
    frames: int,
    cache_dtype: torch.dtype | None = None,
) -> list[StepCache]:
    """The step caches of a voice prompt's first ``frames`` frames (a multiple of the
    attention chunk, at most :func:`primed_prompt_frames`), trimmed to them: what a stream
    of this voice would have cached after them, but for the look-ahead of the prompt's
    last tokens, read as zeros. Arguments on the flow's device, as for :class:`Flow3Stream`;
    ``cache_dtype``: what the keys and values are held in (None: the flow's dtype)."""
    if frames <= 0 or frames % flow.cfg.dit.static_chunk_size:
        raise ValueError(f"cannot prime {frames} frames: whole attention chunks only")
    dtype = next(flow.parameters()).dtype
    mu = flow.token_features(prompt_token, None)[:, :, :frames]  # (1, 80, frames)
    if mu.shape[2] < frames or prompt_feat.shape[1] < frames:
        raise ValueError(f"cannot prime {frames} frames of a shorter prompt")
    cond = flow.conditions(prompt_feat[:, :frames].to(dtype), frames)
    caches = [StepCache(flow.cfg.dit.depth, frames, cache_dtype) for _ in range(flow.cfg.cfm.n_timesteps)]
    flow.cfm(mu, flow.speaker(embedding.to(dtype)), cond, True, caches)
    for cache in caches:
        cache.commit(frames)
    return [cache.trimmed() for cache in caches]


def stream_cache_bytes(flow: Flow3, frames: int, cache_dtype: torch.dtype | None = None) -> int:
    """The memory a stream's caches hold at ``frames`` frames of its own: keys and values
    of both guidance rows, every layer and Euler step, in ``cache_dtype`` (None: the
    flow's dtype; convolution tails aside: a few frames each)."""
    cfg = flow.cfg
    row = row_bytes(cfg.dit.dim_head, cache_dtype or next(flow.parameters()).dtype)
    return frames * 2 * 2 * cfg.dit.heads * row * cfg.dit.depth * cfg.cfm.n_timesteps
