"""Repetition-aware sampling of speech tokens (VALL-E 2 RAS, as CosyVoice 2 configures it).

Semantics follow upstream ``cosyvoice/utils/common.py`` (``ras_sampling``,
``nucleus_sampling``, ``random_sampling``) token for token:

1. ``p = softmax(log_probs)``, sorted descending with a stable sort (ties keep id order).
2. Nucleus: walk the sorted list keeping tokens while the probability kept so far is
   ``< top_p`` and fewer than ``top_k`` are kept, so the token that crosses ``top_p`` is
   kept. The running sum is accumulated in the dtype of ``p`` one token at a time, exactly
   like upstream's loop, because the crossing decision is sensitive to the last bit.
3. Draw one kept token with probability proportional to its (un-renormalised) ``p``.
4. If that token occurs ``>= win_size * tau_r`` times among the last ``win_size`` emitted
   tokens, draw again from the full distribution ``p`` instead. CosyVoice 2's reference
   package keeps the repeated token in that draw; later upstream revisions, CosyVoice 3's
   reference, ban it (``ban_repeat``: its probability is zeroed, the rest keep their
   proportions, as upstream's softmax over the masked scores).

Every draw is an inverse-CDF lookup on a uniform in [0, 1) from the request's own
``torch.Generator``, two uniforms per step (the second used only by the fallback), so a
request's tokens depend on nothing but its seed and its logits.

End of generation (see :class:`LengthLimits`): the stop ids come from the LM's config,
6561 (eos), 6562 and 6563 in CosyVoice 2, 6561..6760 in CosyVoice 3. Below the minimum
length upstream forbids index 6561 only (eos in CosyVoice 2, sos in CosyVoice 3), so a
model may still end early through another stop id; that is kept for upstream parity. A
forced length (like vLLM's ``min_tokens`` / ``ignore_eos``, needed to get predictable
lengths from random weights) forbids them all.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from cosyserve.errors import InvalidRequestError
from cosyserve.modeldir.hparams import SamplingConfig, SpeechLMConfig

# Uniforms per sampling step: the nucleus draw and the repetition fallback.
UNIFORMS_PER_STEP = 2


@dataclass(frozen=True)
class LengthLimits:
    """How many speech tokens one request generates.

    Contract for a decode loop: before a step, a request with ``max_tokens`` tokens emitted
    is finished; otherwise it samples with :meth:`masked_ids` (for the tokens emitted so
    far) forbidden; a sampled stop id ends the request and is not emitted.
    """

    min_tokens: int
    max_tokens: int
    stop_ids: tuple[int, ...]
    # The stop ids forbidden while fewer than min_tokens tokens were emitted.
    masked_below_min: tuple[int, ...]

    def __post_init__(self) -> None:
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError(
                f"token limits must satisfy 0 <= min ({self.min_tokens}) <= max ({self.max_tokens})"
            )
        if not set(self.masked_below_min) <= set(self.stop_ids):
            raise ValueError("masked_below_min must be a subset of stop_ids")

    @classmethod
    def for_text(cls, num_text_tokens: int, cfg: SpeechLMConfig) -> "LengthLimits":
        """Upstream's limits: ``int(n * 2)`` to ``int(n * 20)`` tokens for ``n`` target-text
        tokens (the prompt text does not count); below the minimum only
        ``cfg.ids_masked_below_min_len`` is forbidden."""
        return cls(
            min_tokens=int(num_text_tokens * cfg.min_token_text_ratio),
            max_tokens=int(num_text_tokens * cfg.max_token_text_ratio),
            stop_ids=cfg.stop_token_ids,
            masked_below_min=cfg.ids_masked_below_min_len,
        )

    @classmethod
    def forced(cls, min_tokens: int, max_tokens: int, cfg: SpeechLMConfig) -> "LengthLimits":
        """Explicit limits that no stop id can undercut (all are forbidden below
        ``min_tokens``); ``min_tokens == max_tokens`` fixes the length exactly."""
        stops = cfg.stop_token_ids
        return cls(min_tokens=min_tokens, max_tokens=max_tokens, stop_ids=stops, masked_below_min=stops)

    def masked_ids(self, emitted: int) -> tuple[int, ...]:
        """Stop ids to forbid at the step after ``emitted`` emitted tokens."""
        return self.masked_below_min if emitted < self.min_tokens else ()


def draw_uniforms(generators: Sequence[torch.Generator], device: torch.device) -> torch.Tensor:
    """The next step's uniforms of each request: (B, UNIFORMS_PER_STEP) float64 on ``device``."""
    rows = [
        torch.rand(UNIFORMS_PER_STEP, generator=g, dtype=torch.float64, device=g.device) for g in generators
    ]
    return torch.stack([r.to(device) for r in rows])


def inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Index drawn from each row of ``weights`` (B, N) >= 0 (not necessarily normalised)
    by ``uniforms`` (B,) in [0, 1): the first index whose float64 cumulative weight exceeds
    ``u * total``, never an index of zero weight. Returns (B,) long."""
    cum = weights.double().cumsum(-1)  # (B, N)
    threshold = uniforms.double() * cum[:, -1]
    index = torch.searchsorted(cum, threshold[:, None], right=True)[:, 0]
    # u * total can round up to total; fall back to the last token that has weight.
    positions = torch.arange(weights.shape[-1], device=weights.device)
    last_positive = torch.where(weights > 0, positions, 0).amax(-1)
    return torch.minimum(index, last_positive)


def mask_ids(log_probs: torch.Tensor, masked: Sequence[tuple[int, ...]]) -> torch.Tensor:
    """A copy of ``log_probs`` (B, V) with row b's ids ``masked[b]`` set to -inf."""
    out = log_probs.clone()
    for row, ids in enumerate(masked):
        if ids:
            out[row, list(ids)] = float("-inf")
    return out


def ras_draw(
    log_probs: torch.Tensor,
    windows: torch.Tensor,
    uniforms: torch.Tensor,
    cfg: SamplingConfig,
    ban_repeat: bool = False,
) -> torch.Tensor:
    """Repetition-aware sampling of B rows with given uniforms (see the module docstring).

    ``log_probs``: (B, V) float. ``windows``: (B, W) long, each row's last ``win_size``
    emitted tokens, padded with -1. ``uniforms``: (B, 2) float64. Returns (B,) long.
    """
    _check_config(cfg)
    probs = log_probs.softmax(-1)  # (B, V)
    k = min(cfg.top_k, probs.shape[-1])
    sorted_p, sorted_ids = stable_top_k(probs, k)  # (B, k) each
    cum = running_sums(sorted_p)  # (B, k)
    # Token i is kept while the sum *before* it is < top_p: token 0 always, then every i
    # with cum[i - 1] < top_p (cum only grows, so the kept tokens form a prefix).
    kept = torch.ones_like(cum, dtype=torch.bool)
    kept[:, 1:] = cum[:, :-1] < cfg.top_p
    choice = inverse_cdf(torch.where(kept, sorted_p, 0), uniforms[:, 0])
    tokens = sorted_ids.gather(-1, choice[:, None])[:, 0]  # (B,)
    repeats = (windows == tokens[:, None]).sum(-1)
    fallback = repeats >= cfg.win_size * cfg.tau_r
    if not bool(fallback.any()):  # the draw from the whole distribution is rarely needed
        return tokens
    if ban_repeat:
        probs = probs.scatter(-1, tokens[:, None], 0.0)
    return torch.where(fallback, inverse_cdf(probs, uniforms[:, 1]), tokens)


def running_sums(values: torch.Tensor) -> torch.Tensor:
    """Inclusive running sums along the last axis of ``values`` (B, k), float32 or float64,
    added one at a time in that dtype, as upstream's loop adds (``cum_prob += prob``).

    numpy's ``cumsum`` adds in order in the array's dtype; torch's CPU ``cumsum``
    accumulates float32 in float64 and rounds each sum once, which can move the crossing
    of ``top_p`` by a bit. One call instead of 25 additions takes about a tenth off a
    batch-1 sampling step."""
    if values.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"running sums are taken in float32 or float64, not {values.dtype}")
    sums = np.cumsum(values.detach().cpu().numpy(), axis=-1)
    return torch.from_numpy(sums).to(values.device)


def stable_top_k(probs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``k`` columns of ``probs.sort(dim=-1, descending=True, stable=True)``:
    values and ids ``(B, k)``, ties in id order, for ``probs`` (B, V) >= 0.

    A full stable sort of the 6564 speech ids was most of a decode step's sampling. For
    float32 the same order comes from one top-k of distinct integer keys, about 30x faster
    at batch 8: a non-negative float's bits, read as an integer, order as the float does,
    and the id's complement below them orders ties by id."""
    vocab = probs.shape[-1]
    id_bits = max(1, (vocab - 1).bit_length())
    if probs.dtype != torch.float32 or id_bits > 32:
        values, ids = probs.sort(dim=-1, descending=True, stable=True)
        return values[:, :k], ids[:, :k]
    low = (1 << id_bits) - 1
    complement = low - torch.arange(vocab, device=probs.device)
    keys = (probs.view(torch.int32).to(torch.int64) << id_bits) | complement  # (B, V), all distinct
    ids = low - (keys.topk(k, dim=-1).values & low)
    return probs.gather(-1, ids), ids


def sample_tokens(
    log_probs: torch.Tensor,
    histories: Sequence[Sequence[int]],
    generators: Sequence[torch.Generator],
    limits: Sequence[LengthLimits],
    cfg: SamplingConfig,
    ban_repeat: bool = False,
) -> torch.Tensor:
    """Sample the next speech token of B requests at once.

    ``log_probs``: (B, V) float speech log-probs. ``histories[b]``: the tokens request b
    has emitted (stop ids never among them); ``generators[b]``, ``limits[b]``: its own.
    Returns (B,) long on ``log_probs``' device; each row equals what
    :func:`sample_token` gives for that request alone.
    """
    if not len(histories) == len(generators) == len(limits) == log_probs.shape[0]:
        raise ValueError("one history, generator and limit per row of log_probs")
    scores = mask_ids(log_probs, [lim.masked_ids(len(h)) for lim, h in zip(limits, histories, strict=True)])
    w = cfg.win_size
    recent = [list(h[-w:]) for h in histories]
    windows = torch.tensor([r + [-1] * (w - len(r)) for r in recent]).to(log_probs.device)  # (B, win_size)
    return ras_draw(scores, windows, draw_uniforms(generators, log_probs.device), cfg, ban_repeat)


def sample_token(
    log_probs: torch.Tensor,
    history: Sequence[int],
    generator: torch.Generator,
    limits: LengthLimits,
    cfg: SamplingConfig,
) -> int:
    """Sample one request's next token from ``log_probs`` (V,); see :func:`sample_tokens`."""
    return int(sample_tokens(log_probs[None], [history], [generator], [limits], cfg)[0])


def _check_config(cfg: SamplingConfig) -> None:
    if cfg.top_k < 1 or cfg.win_size < 1 or not 0.0 < cfg.top_p <= 1.0 or cfg.tau_r < 0:
        raise InvalidRequestError(
            f"invalid sampling options: top_k={cfg.top_k}, top_p={cfg.top_p}, "
            f"win_size={cfg.win_size}, tau_r={cfg.tau_r}"
        )
