"""Where streaming token2wav cuts the speech-token stream into chunks.

Upstream CosyVoice2Model streams chunks of a 25-token hop plus 3 lookahead tokens, the
first hop padded so that prompt + first hop ends on a 25-token boundary (the flow's
streaming attention is block-causal in 25-token blocks counted from the prompt's start),
and a final chunk over everything with full attention. Since its commit ace7c47 the hop
doubles after every chunk up to 100 tokens (25, 50, 100, 100, ...), kept on the shared
model object, so that it grows across requests and races between concurrent ones
(docs/streaming.md). ``ChunkSchedule`` with ``max_hop=100`` reproduces that schedule
within one request; without, the hop stays 25 (the older upstream's schedule): with the
incremental flow cache a chunk costs about its own tokens, so a constant short hop keeps
audio flowing evenly at no extra cost. With ``first_hop`` set, the first chunk is cut
early for lower first-packet latency and the next chunk re-aligns to the block grid, so
every later chunk again ends on a block boundary.

Each request owns its schedule: nothing here is shared between requests.
"""

from dataclasses import dataclass

from cosyserve.errors import InvalidRequestError

# Upstream's ``token_max_hop_len`` and ``stream_scale_factor``.
UPSTREAM_MAX_HOP = 100
HOP_GROWTH = 2


@dataclass(frozen=True)
class Chunk:
    """One token2wav call.

    ``token_end``: how many generated tokens the flow sees (lookahead included);
    ``offset``: tokens already emitted (the flow's mel is sliced from ``2 * offset``);
    ``finalize``: the last call, over all tokens, with full attention.
    """

    token_end: int
    offset: int
    finalize: bool


class ChunkSchedule:
    """Per-request chunk cursor for streaming synthesis."""

    def __init__(
        self,
        prompt_tokens: int,
        *,
        hop: int = 25,
        lookahead: int = 3,
        first_hop: int | None = None,
        max_hop: int | None = None,
    ) -> None:
        """``hop``: the block size, and the hop between chunks; ``max_hop``: the hop doubles
        after each chunk up to this (a multiple of ``hop``), None: it stays ``hop``."""
        if prompt_tokens < 0 or hop < 1 or lookahead < 0 or (max_hop is not None and max_hop % hop):
            raise InvalidRequestError("invalid chunking parameters")
        if first_hop is not None and first_hop < 1:
            raise InvalidRequestError("first_hop must be at least 1 token")
        self._prompt = prompt_tokens
        self._hop = hop
        self._lookahead = lookahead
        self._first_hop = first_hop
        self._max_hop = max_hop or hop
        self._hop_now = hop
        self.offset = 0
        self.done = False

    def _next_hop(self) -> int:
        # Tokens from the prompt's start to the next block boundary after the cursor.
        to_boundary = -(self._prompt + self.offset) % self._hop
        if self.offset == 0:
            aligned = self._hop + to_boundary
            if self._first_hop is not None and self._first_hop < aligned:
                return self._first_hop
            return aligned
        return to_boundary if to_boundary > 0 else self._hop_now

    def peek(self, available: int, finished: bool) -> Chunk | None:
        """The next chunk to synthesise given ``available`` generated tokens, or None to
        wait; the cursor does not move (see :meth:`advance`).

        ``finished``: the token stream has ended (no more tokens will come), which makes
        the remaining tokens the final chunk.
        """
        if self.done:
            return None
        hop = self._next_hop()
        if available - self.offset >= hop + self._lookahead:
            return Chunk(token_end=self.offset + hop + self._lookahead, offset=self.offset, finalize=False)
        if finished:
            return Chunk(token_end=available, offset=self.offset, finalize=True)
        return None

    def advance(self, chunk: Chunk) -> None:
        """Move the cursor past ``chunk`` (the one :meth:`peek` returned)."""
        if chunk.offset != self.offset or self.done:
            raise ValueError("the chunk does not continue this schedule")
        if chunk.finalize:
            self.done = True
        else:
            self.offset = chunk.token_end - self._lookahead
            self._hop_now = min(self._max_hop, self._hop_now * HOP_GROWTH)

    def next_chunk(self, available: int, finished: bool) -> Chunk | None:
        """:meth:`peek` and :meth:`advance` in one."""
        chunk = self.peek(available, finished)
        if chunk is not None:
            self.advance(chunk)
        return chunk
