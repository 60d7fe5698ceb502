"""Engine options, fixed at start."""

from dataclasses import dataclass

import torch

from cosyserve.accel.flow_cache_mode import (
    DEFAULT_FLOW_PROMPT_CACHE_MB,
    FLOW_CACHE_DTYPES,
    FLOW_CACHE_MODES,
    FlowCacheDtype,
    FlowCacheMode,
    flow_prompt_whole_problem,
)
from cosyserve.engine.admission import DEFAULT_MAX_ACTIVE, DEFAULT_MAX_WAITING

__all__ = ["FLOW_CACHE_MODES", "EngineConfig", "FlowCacheMode"]


@dataclass(frozen=True)
class EngineConfig:
    """How much the engine holds and does per step.

    ``max_active``: requests holding an LM KV-cache slot at once (the decode batch bound).
    ``max_waiting``: requests queued beyond those; more are refused at admission
    (:mod:`cosyserve.engine.admission`, which holds both defaults).
    ``max_len``: LM positions per sequence (prompt + text + generated tokens).
    ``prefill_chunk``: LM prefill positions per step while requests decode, so a long
    prompt cannot stall everyone's decode for long (with none decoding, prompts go in
    whole).
    ``token2wav_batch``: ready token2wav chunks (flow + HiFT) run per step, as batches;
    first chunks go first, then arrival order.
    ``flow_cache``: streaming flow work per chunk: ``"exact"`` recomputes prompt + all
    tokens (upstream), ``"cached"`` reuses cached states for intermediate chunks (same
    output), ``"incremental"`` for the final chunk too (cheapest; that chunk deviates).
    ``prefix_cache_positions``: LM positions whose keys and values are kept for reuse by
    later requests with the same input start (a voice's prompt text); 0 disables it.
    ``flow_prompt_cache_mb``: MiB of primed flow stream states kept per voice prompt so a
    stream's first chunk skips the prompt (``"cached"``/``"incremental"`` only; 0 disables
    it). A 3 s prompt primes 100 mel frames, about 440 MiB in fp32 on the full model (220 MiB
    in bf16/fp16): the default holds 8 such voices in fp32.
    ``flow_prompt_whole``: prime every whole block of a voice prompt, the last block's
    look-ahead past the prompt read as zeros (``Flow.prime_stream``'s ``whole``): when a
    prompt ends on or just after a block boundary (a 3 s prompt does), a stream's first
    chunk no longer recomputes the prompt's last block (10 frames instead of 60), at the
    cost of a small deviation from upstream, largest in the first chunk
    (``docs/streaming.md``, "Primed voice prompts"). Needs the prompt cache. Both apply to
    CosyVoice 3 streams too (``Flow3PromptCache``: a 3 s prompt primes 100 frames, 348 MiB
    in fp32 on the full model, or 150 frames primed whole).
    ``flow_stream_cache_mb``: MiB the streams' incremental flow caches may hold together
    (0: no bound). Each streamed segment reserves the most its cache can reach (on the
    full model in bf16, per mel frame of prompt + tokens: 0.56 MiB with compact caches,
    2.2 MiB without, x1.5 where buffers grow); a segment that does not fit recomputes
    every chunk as ``"exact"`` does.
    ``flow_cache_compact``: a stream's own positions in its incremental flow cache keep
    each estimator attention layer's input (256 channels on the full model) instead of its
    keys and values (2 x 512), which are recomputed from it every chunk (one GEMM per
    layer over the history); the positions shared with a voice's primed prompt stay keys
    and values. A stream's cache takes about a quarter of the memory for a little more
    time per single stream, and concurrent streams run as fast, with fewer page faults
    (``docs/streaming.md``, "Memory"). Same output: the keys and values are the same
    products.
    ``flow_cache_dtype``: what incremental stream caches hold their keys and values
    (compact caches: their inputs) in, read back converted (``docs/precision.md``):
    ``computed`` as the flow computes; ``fp16`` a float32 flow's streams and primed
    prompts in float16, half the memory (ignored for a 16-bit flow); ``int8`` a stream's
    own positions as int8 rows with a float32 scale each, about a quarter of float32's
    memory, the primed prompts as with ``fp16``.
    ``flow_stream_rows``: incremental streaming chunks per flow call (0: no bound). A
    traced call holds every batched row's cached keys and values at once (56 layers x
    rows x history: about 830 MiB for 8 streams at 450 frames), while on a CPU a pass
    over 2, 4 or 8 streams' chunks costs the same per stream.
    ``cuda_graphs``: on a CUDA device, replay decode steps from CUDA graphs captured at
    start (``cosyserve.engine.decode_graphs``), and a flow call's later Euler steps from
    a graph of its own when the call has no cached state
    (``cosyserve.models.flow.step_graph``); ignored elsewhere.
    ``traced_decode``: on a CPU, replay decode steps from TorchScript traces made at start,
    which skips the Python between a step's ops (``cosyserve.engine.decode_graphs``). Two
    traces serve every step, one for a lone row and one for larger batches, each over any
    span: on the full bf16 + int8 model they take about 2 s and 150 MiB at start (each a
    TorchScript graph and its execution plan) and about a quarter off a decode step, alone
    and batched, with the eager step's bits (``docs/precision.md``, "Notes"). Ignored
    elsewhere; where the LM cannot be traced (a compiled one: ``engine_config_for`` turns
    this off), steps run eagerly.
    ``traced_flow``: on a CPU, replay the flow estimator's incremental streaming calls and
    its non-streaming calls from TorchScript traces made at start (``Flow.trace_steps_``;
    three for a bf16 flow): on the full bf16 model they take about a quarter off a
    stream's first chunk and a fifth off a whole stream's flow (a non-streaming flow gains
    less), the same bits, for about 4.5 s of start-up and 230 MiB. Ignored
    elsewhere and with ``flow_cache = "exact"``.
    ``first_hop``: tokens in a stream's first chunk when its request names none (None:
    upstream's, the first hop padded to the 25-token block grid).
    ``hop_growth``: upstream's schedule from its commit ace7c47 on, per request: each
    chunk's hop doubles up to 100 tokens (25, 50, 100, ...). Off, the hop stays 25: with
    the incremental flow cache a chunk costs its own tokens, so short hops cost no more in
    all and keep the audio flowing evenly.
    """

    max_active: int = DEFAULT_MAX_ACTIVE
    max_waiting: int = DEFAULT_MAX_WAITING
    max_len: int = 2048
    prefill_chunk: int = 256
    token2wav_batch: int = 8
    flow_cache: FlowCacheMode = "incremental"
    prefix_cache_positions: int = 2048
    flow_prompt_cache_mb: int = DEFAULT_FLOW_PROMPT_CACHE_MB
    flow_prompt_whole: bool = False
    flow_stream_cache_mb: int = 0
    flow_cache_compact: bool = True
    flow_cache_dtype: FlowCacheDtype = "computed"
    flow_stream_rows: int = 2
    cuda_graphs: bool = True
    traced_decode: bool = True
    traced_flow: bool = True
    first_hop: int | None = None
    hop_growth: bool = False
    dtype: torch.dtype = torch.float32
    device: str = "cpu"

    def __post_init__(self) -> None:
        for name in ("max_active", "max_len", "prefill_chunk", "token2wav_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.max_waiting < 0:
            raise ValueError("max_waiting must not be negative")
        if self.flow_cache not in FLOW_CACHE_MODES:
            raise ValueError(f"flow_cache must be one of {FLOW_CACHE_MODES}")
        if self.flow_cache_dtype not in FLOW_CACHE_DTYPES:
            raise ValueError(f"flow_cache_dtype must be one of {FLOW_CACHE_DTYPES}")
        if self.prefix_cache_positions < 0:
            raise ValueError("prefix_cache_positions must not be negative")
        for name in ("flow_prompt_cache_mb", "flow_stream_cache_mb", "flow_stream_rows"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative")
        if self.first_hop is not None and self.first_hop < 1:
            raise ValueError("first_hop must be at least 1")
        problem = flow_prompt_whole_problem(
            self.flow_prompt_whole, self.flow_cache, self.flow_prompt_cache_mb
        )
        if problem:
            raise ValueError(problem)
