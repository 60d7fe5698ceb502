"""The per-request encoder interface shared by every response format."""

import logging
from abc import ABC, abstractmethod
from types import TracebackType
from typing import Self

import numpy as np
from numpy.typing import NDArray

from cosyserve.audio.resample import StreamResampler

logger = logging.getLogger(__name__)


def as_mono_float32(chunk: NDArray[np.floating]) -> NDArray[np.float32]:
    """``chunk`` as a 1-D float32 array; accepts shape ``(n,)`` or ``(1, n)``."""
    if not np.issubdtype(chunk.dtype, np.floating):
        # Integer PCM would pass the conversion below and come out as full-scale noise.
        raise TypeError(f"audio chunks must be float samples in [-1, 1], got {chunk.dtype}")
    if chunk.ndim == 2 and chunk.shape[0] == 1:
        chunk = chunk[0]
    if chunk.ndim != 1:
        raise ValueError(f"audio chunks must be mono, shape (n,) or (1, n); got {chunk.shape}")
    return np.ascontiguousarray(chunk, dtype=np.float32)


class AudioEncoder(ABC):
    """Turns float mono audio, arriving chunk by chunk, into the bytes of one response.

    Call :meth:`encode` per chunk and send what it returns, then send :meth:`finish`.
    A streamed encoder returns bytes as soon as the codec has them (the first call also
    carries the container header); a whole-response encoder (``stream=False``) returns
    nothing from :meth:`encode` and the complete file from :meth:`finish`. Samples are
    resampled from ``source_rate`` to :attr:`sample_rate` on the way in.

    One encoder serves one response and is not thread-safe. :meth:`close` (or leaving a
    ``with`` block) frees codec resources; :meth:`finish` closes too, and a request that
    ends early (client disconnect) must still close.
    """

    def __init__(self, *, source_rate: int, sample_rate: int, content_type: str, stream: bool) -> None:
        self.sample_rate = sample_rate
        self.content_type = content_type
        self.stream = stream
        self._resampler = StreamResampler(source_rate, sample_rate)
        self._finished = False
        self._closed = False

    def encode(self, chunk: NDArray[np.floating]) -> bytes:
        """Encode the next chunk (any length, empty included); returns the bytes ready to send."""
        self._check_open()
        return self._encode(self._resampler.process(as_mono_float32(chunk)))

    def finish(self) -> bytes:
        """Flush everything still buffered and end the stream; returns the last bytes."""
        self._check_open()
        data = self._encode(self._resampler.flush()) + self._finish()
        self._finished = True
        self.close()
        return data

    def close(self) -> None:
        """Free the encoder's resources; safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        if not self._finished:
            logger.debug("%s closed before finish(); output abandoned", type(self).__name__)
        self._release()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{type(self).__name__} is already finished or closed")

    @abstractmethod
    def _encode(self, samples: NDArray[np.float32]) -> bytes:
        """Encode resampled samples at :attr:`sample_rate`."""

    @abstractmethod
    def _finish(self) -> bytes:
        """Flush the codec and container; called once, after the last :meth:`_encode`."""

    @abstractmethod
    def _release(self) -> None:
        """Free codec resources; called once, by :meth:`close`."""
