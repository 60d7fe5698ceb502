"""Options of the gRPC server, fixed at start."""

from dataclasses import dataclass, field

from cosyserve.pipeline.request import SynthesisOptions


@dataclass(frozen=True)
class GrpcConfig:
    """``upstream_options``: the synthesis options of every request on upstream's proto,
    which has no fields for them (e.g. a fixed seed, or forced token counts for benchmarks
    on random weights, which never stop on their own).
    ``max_text_chars``: the longest text a request may carry (None: no limit).
    ``max_message_bytes``: the largest request message (prompt audio rides in it).
    """

    upstream_options: SynthesisOptions = field(default_factory=SynthesisOptions)
    max_text_chars: int | None = 2000
    max_message_bytes: int = 10 * 1024 * 1024

    def __post_init__(self) -> None:
        if self.max_text_chars is not None and self.max_text_chars < 1:
            raise ValueError("max_text_chars must be positive")
        if self.max_message_bytes < 1024:
            raise ValueError("max_message_bytes must be at least 1024")
