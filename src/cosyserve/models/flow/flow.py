"""The CosyVoice 2 flow (upstream ``CausalMaskedDiffWithXvec``): speech tokens, a voice
prompt and a speaker embedding -> 80-bin log-mel frames at 50 Hz."""

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cosyserve.errors import InvalidRequestError, ModelDirError
from cosyserve.modeldir.hparams import FlowConfig
from cosyserve.models.embedding import embedding
from cosyserve.models.flow.blocks import SelfAttention
from cosyserve.models.flow.cfm import CFM
from cosyserve.models.flow.conformer import RelPositionAttention
from cosyserve.models.flow.encoder import UpsampleConformerEncoder
from cosyserve.models.flow.estimator import Estimator
from cosyserve.models.flow.stream_cache import FlowStreamCache
from cosyserve.models.flow.table import flow_checkpoint_table
from cosyserve.models.flow.traced_steps import TracedSteps
from cosyserve.models.int8_rows import row_bytes
from cosyserve.models.trace_cache import TraceCache

# The model-directory tools take the module and its checkpoint table from here.
__all__ = ["Flow", "check_flow_config", "flow_checkpoint_table"]


def check_flow_config(cfg: FlowConfig) -> None:
    """Raise :class:`ModelDirError` for a geometry this implementation (or upstream) cannot run."""
    enc, est = cfg.encoder, cfg.estimator
    problems = []
    if len(est.channels) != 1:
        problems.append(f"estimator channels {est.channels} (only one level is supported)")
    if est.act_fn != "gelu":
        problems.append(f"estimator act_fn {est.act_fn!r} (only 'gelu' is supported)")
    if cfg.cfm.t_scheduler not in ("cosine", "linear"):
        problems.append(f"t_scheduler {cfg.cfm.t_scheduler!r}")
    # The estimator input is [x, mu, spks, cond], each output_size (80) channels.
    if est.in_channels != 4 * cfg.output_size or est.out_channels != cfg.output_size:
        problems.append(f"estimator channels in/out {est.in_channels}/{est.out_channels}")
    if cfg.cfm.spk_emb_dim != cfg.output_size:
        problems.append(f"spk_emb_dim {cfg.cfm.spk_emb_dim} != output_size {cfg.output_size}")
    if enc.input_size != cfg.input_size or enc.output_size != enc.input_size:
        problems.append(f"encoder sizes {enc.input_size}/{enc.output_size} with token size {cfg.input_size}")
    if enc.upsample_stride != cfg.token_mel_ratio:
        problems.append(f"encoder upsampling x{enc.upsample_stride} != token_mel_ratio {cfg.token_mel_ratio}")
    if enc.attention_heads <= 0 or enc.output_size % enc.attention_heads:
        problems.append(f"encoder width {enc.output_size} not divisible by {enc.attention_heads} heads")
    if enc.static_chunk_size < 1 or est.static_chunk_size < 1:
        sizes = f"{enc.static_chunk_size}/{est.static_chunk_size}"
        problems.append(f"streaming chunk sizes {sizes} (must be at least 1)")
    if problems:
        raise ModelDirError("unsupported flow configuration: " + "; ".join(problems))


class Flow(nn.Module):
    """Token-to-mel model. Load weights with :func:`flow_checkpoint_table` (``flow.pt``)."""

    def __init__(self, cfg: FlowConfig) -> None:
        super().__init__()
        check_flow_config(cfg)
        self.cfg = cfg
        self.pre_lookahead_len = cfg.pre_lookahead_len
        self.token_mel_ratio = cfg.token_mel_ratio
        self.token_embedding = embedding(cfg.vocab_size, cfg.input_size)
        self.speaker_proj = nn.Linear(cfg.spk_embed_dim, cfg.output_size)
        self.encoder = UpsampleConformerEncoder(cfg.encoder, cfg.pre_lookahead_len)
        self.mu_proj = nn.Linear(self.encoder.output_size, cfg.output_size)
        self.cfm = CFM(cfg.cfm, Estimator(cfg.estimator), cfg.output_size)
        # Incremental streaming caches whole attention blocks of the encoder (in tokens and,
        # upsampled, in frames) and of the estimator (in frames): it commits tokens in
        # multiples of the shortest span that ends on a block boundary in all three.
        stride = cfg.encoder.upsample_stride
        frame_unit = math.lcm(cfg.encoder.static_chunk_size * stride, cfg.estimator.static_chunk_size)
        self.stream_block = frame_unit // stride

    def fuse_projections_(self) -> None:
        """Stack the q/k/v projections of every estimator attention into one Linear
        (:meth:`SelfAttention.fuse_projections_`): the same outputs from fewer, larger GEMMs.
        The loader does this once the checkpoint is read (the checkpoint table names the
        separate projections). The stacked weights are a copy: with float32 weights, which
        otherwise stay memory-mapped from ``flow.pt``, 84 MiB of private memory on the
        full-size model. The ``kv`` of compact caches views ``qkv``'s k and v rows (packed
        bfloat16 weights copy it: 28 MiB)."""
        for module in self.modules():
            if isinstance(module, SelfAttention):
                module.fuse_projections_()

    def use_fused_bf16_attention_(self, fused: bool) -> None:
        """Whether every attention layer runs bfloat16 on a CPU in torch's fused kernel
        (:func:`~cosyserve.models.flow.attention.attention`): the faster one with AMX tiles
        only. Set before :meth:`trace_steps_`, which records the kernel chosen."""
        for module in self.modules():
            if isinstance(module, (SelfAttention, RelPositionAttention)):
                module.fused_bf16 = fused

    def trace_steps_(self, cache: TraceCache | None = None) -> bool:
        """Replay the estimator's calls from TorchScript traces
        (:mod:`cosyserve.models.flow.traced_steps`), recorded now (or taken from ``cache``)
        unless they were already; False where the estimator cannot be traced (the calls
        then run eagerly)."""
        if self.cfm.traced_steps is None:
            steps = TracedSteps(self.cfm.estimator)
            if not steps.capture(self.speaker_proj.weight.dtype, cache):
                return False
            self.cfm.traced_steps = steps
        return True

    @torch.inference_mode()
    def inference(
        self,
        token: Tensor,
        prompt_token: Tensor,
        prompt_feat: Tensor,
        embedding: Tensor,
        streaming: bool,
        finalize: bool,
    ) -> Tensor:
        """Mel frames for ``token``, continuing the voice prompt.

        ``token``: ``(B, N)`` int speech tokens (ids ``< vocab_size``; negatives act as 0).
        ``prompt_token``: ``(B, P)`` int prompt speech tokens, ``P >= 0``.
        ``prompt_feat``: ``(B, P_mel, 80)`` prompt log-mel (normally ``P_mel = 2P``), cast to
        the model dtype. ``embedding``: ``(B, spk_embed_dim)`` speaker x-vector, unnormalised.
        ``streaming``: block-causal attention (chunks of 25 tokens / 50 frames counted from
        the start of the prompt) instead of full attention.
        ``finalize``: ``token`` ends the utterance. If False, its last ``pre_lookahead_len``
        tokens are look-ahead context only and get no frames of their own.

        Rows of a batch share ``N``, ``P`` and ``P_mel``. Returns ``(B, 80, T)`` float32 with
        ``T = 2 (P + N - (0 if finalize else pre_lookahead_len)) - P_mel``: the frames after
        the prompt.
        """
        self._check_inputs(token, prompt_token, prompt_feat, embedding, finalize)
        dtype = self.speaker_proj.weight.dtype
        spks = self.speaker_proj(F.normalize(embedding.to(dtype), dim=1))  # (B, 80)

        tokens = torch.cat([prompt_token, token], dim=1)  # (B, P+N)
        x = self.token_embedding(tokens.clamp(min=0))  # (B, P+N, D)
        batch, size, _ = x.shape
        lengths = torch.full((batch,), size, device=x.device, dtype=torch.long)
        if finalize:
            h, _ = self.encoder(x, lengths, None, streaming)
        else:
            lookahead = self.pre_lookahead_len
            h, _ = self.encoder(x[:, :-lookahead], lengths - lookahead, x[:, -lookahead:], streaming)
        mu = self.mu_proj(h).transpose(1, 2)  # (B, 80, T_all)

        prompt_frames = prompt_feat.shape[1]
        cond = torch.zeros_like(mu)
        cond[:, :, :prompt_frames] = prompt_feat.transpose(1, 2).to(mu.dtype)
        mask = mu.new_ones(batch, 1, mu.shape[2])
        mel: Tensor = self.cfm(mu, mask, spks, cond, streaming)  # (B, 80, T_all) float32
        return mel[:, :, prompt_frames:]

    def new_stream_cache(self, compact: bool = False, dtype: torch.dtype | None = None) -> FlowStreamCache:
        """An empty cache for one stream of :meth:`stream` calls (``compact``, ``dtype``:
        see :class:`FlowStreamCache`)."""
        return FlowStreamCache(self.cfg.cfm.n_timesteps, compact, dtype)

    @torch.inference_mode()
    def stream(
        self,
        cache: FlowStreamCache,
        token: Tensor,
        prompt_token: Tensor,
        prompt_feat: Tensor,
        embedding: Tensor,
        offset: int,
        finalize: bool,
    ) -> Tensor:
        """Incremental streaming: the mel frames of ``token[:, offset:]`` (lookahead
        excluded unless ``finalize``), equal up to float rounding to
        ``inference(token, ..., streaming=True, finalize)[:, :, token_mel_ratio * offset:]``
        but computing only the positions after those ``cache`` holds.

        Arguments as for :meth:`inference`; ``token`` is every generated token so far.
        Successive calls on one cache continue one stream: the same prompt and embedding,
        ``token`` extending the previous call's, ``offset`` at or after where the previous
        call's frames end. The positions in complete blocks are cached (those after are
        recomputed next time, e.g. after a short first hop). After ``finalize`` the cache
        is emptied and cannot continue. Returns ``(B, 80, T)`` float32.
        """
        self._check_inputs(token, prompt_token, prompt_feat, embedding, finalize)
        if cache.finished:
            raise ValueError("this flow stream was finalized")
        ratio, lookahead = self.token_mel_ratio, self.pre_lookahead_len
        total = prompt_token.shape[1] + token.shape[1] - (0 if finalize else lookahead)
        start = cache.tokens
        first_frame = prompt_feat.shape[1] + ratio * offset  # absolute frame of the first output
        if offset < 0 or first_frame < ratio * start:
            raise ValueError(f"offset {offset} reaches into the frames already cached")
        if total == start:  # nothing after the cached tokens (possible only when finalizing)
            cache.finish(total, finalize)
            return prompt_feat.new_zeros(token.shape[0], self.cfg.output_size, 0, dtype=torch.float32)

        committed = total if finalize else total // self.stream_block * self.stream_block
        tokens = torch.cat([prompt_token, token], dim=1)
        mel = self._extend(cache, tokens, prompt_feat, embedding, total, committed, finalize)
        return mel[:, :, first_frame - ratio * start :]

    def voice_prefix(self, prompt_tokens: int, prompt_frames: int, whole: bool = False) -> int:
        """Prompt tokens whose streaming states are the same for every stream of the voice.

        A block's positions see the tokens up to the end of their block plus the
        look-ahead, so whole blocks of ``stream_block`` tokens followed by
        ``pre_lookahead_len`` more prompt tokens depend on the voice alone. The prefix also
        stays within the prompt's ``prompt_frames`` mel frames, which no stream emits.

        ``whole``: every whole block of the prompt, the last one's look-ahead past the
        prompt read as zeros instead of the stream's first generated tokens (see
        :meth:`prime_stream`)."""
        reach = 0 if whole else self.pre_lookahead_len
        usable = min(prompt_tokens - reach, prompt_frames // self.token_mel_ratio)
        return max(0, usable) // self.stream_block * self.stream_block

    def stream_cache_bytes(self, tokens: int, compact: bool = False, dtype: torch.dtype | None = None) -> int:
        """The memory of the keys and values of ``tokens`` tokens (prompt included) in a
        :meth:`stream` cache: every attention layer's, the encoder's at token and at frame
        rate and each Euler step's for both CFG branches (``compact``: the estimator
        layers' inputs instead; ``dtype``: what the Euler steps' are held in, None for the
        flow's own). A cache reserved for ``tokens``
        (:meth:`FlowStreamCache.reserve`) holds this much; one left to grow holds up to
        half as much again (its buffers grow x1.5). The convolution contexts, a few frames
        each, are left out."""
        frames = tokens * self.token_mel_ratio
        computed = self.speaker_proj.weight.dtype
        per_token = _key_value_bytes(self.encoder.layers, computed)
        per_frame = _key_value_bytes(self.encoder.up_layers, computed)
        held = dtype or computed
        estimator = self.cfm.estimator
        step = _input_bytes(estimator, held) if compact else _key_value_bytes(estimator, held)
        return per_token * tokens + per_frame * frames + 2 * self.cfg.cfm.n_timesteps * step * frames

    @torch.inference_mode()
    def prime_stream(
        self, prompt_token: Tensor, prompt_feat: Tensor, embedding: Tensor, whole: bool = False
    ) -> FlowStreamCache:
        """A stream cache holding the voice's :meth:`voice_prefix` (possibly nothing), for
        :meth:`FlowStreamCache.fork` to start each stream of the voice from: :meth:`stream`
        then computes only the positions after it, with the same output as from an empty
        cache. Arguments as for :meth:`inference`.

        ``whole``: prime every whole block of the prompt. When the prompt's last block
        looks ahead past the prompt (fewer than ``pre_lookahead_len`` prompt tokens after
        it), its states are computed once with zeros for the look-ahead, as at the end of
        an utterance, instead of being recomputed in every stream's first chunk with that
        stream's first tokens. The first chunk then computes only its own frames (a 3 s
        prompt: 10 frames instead of 60), and every stream of the voice deviates slightly
        from upstream, most in its first chunk (``docs/streaming-flow.md``)."""
        cache = self.new_stream_cache()
        prefix = self.voice_prefix(prompt_token.shape[1], prompt_feat.shape[1], whole)
        if prefix == 0:
            return cache
        # The prefix, with the prompt tokens after it as look-ahead context (fewer only
        # when ``whole``: the encoder reads zeros past them).
        tokens = prompt_token[:, : prefix + self.pre_lookahead_len]
        prompt_feat = prompt_feat[:, : self.token_mel_ratio * prefix]
        short = tokens.shape[1] < prefix + self.pre_lookahead_len
        self._check_inputs(tokens[:, :0], tokens, prompt_feat, embedding, finalize=short)
        self._extend(cache, tokens, prompt_feat, embedding, prefix, prefix, finalize=False)
        return cache

    def _extend(
        self,
        cache: FlowStreamCache,
        tokens: Tensor,
        prompt_feat: Tensor,
        embedding: Tensor,
        total: int,
        committed: int,
        finalize: bool,
    ) -> Tensor:
        """One pass of :meth:`stream` over the positions from ``cache.tokens`` to ``total``
        (``tokens``: ``(B, total [+ lookahead])``, prompt first), caching the first
        ``committed``. Returns their frames ``(B, 80, token_mel_ratio * (total - cache.tokens))``."""
        ratio, start = self.token_mel_ratio, cache.tokens
        dtype = self.speaker_proj.weight.dtype
        spks = self.speaker_proj(F.normalize(embedding.to(dtype), dim=1))  # (B, 80)
        x = self.token_embedding(tokens[:, start:].clamp(min=0))  # (B, total - start [+ lookahead], D)
        batch, new = x.shape[0], total - start
        cache.begin(committed - start, ratio)
        lengths = torch.full((batch,), new, device=x.device, dtype=torch.long)
        context = None if finalize else x[:, new:]
        h, _ = self.encoder(x[:, :new], lengths, context, streaming=True, cache=cache)
        mu = self.mu_proj(h).transpose(1, 2)  # (B, 80, ratio * new)

        cond = torch.zeros_like(mu)
        prompt_feat = prompt_feat[:, ratio * start :]  # the prompt frames among the new ones
        cond[:, :, : prompt_feat.shape[1]] = prompt_feat.transpose(1, 2).to(mu.dtype)
        mask = mu.new_ones(batch, 1, mu.shape[2])
        mel: Tensor = self.cfm(mu, mask, spks, cond, streaming=True, states=cache.steps)
        cache.finish(committed, finalize)
        return mel

    def _check_inputs(
        self, token: Tensor, prompt_token: Tensor, prompt_feat: Tensor, embedding: Tensor, finalize: bool
    ) -> None:
        batch = token.shape[0] if token.dim() == 2 else -1
        mel_bins = self.cfg.output_size
        if (
            token.dim() != 2
            or prompt_token.dim() != 2
            or prompt_token.shape[0] != batch
            or prompt_feat.dim() != 3
            or tuple(prompt_feat.shape[::2]) != (batch, mel_bins)
            or tuple(embedding.shape) != (batch, self.cfg.spk_embed_dim)
        ):
            named = zip(
                ("token", "prompt_token", "prompt_feat", "embedding"),
                (token, prompt_token, prompt_feat, embedding),
                strict=True,
            )
            shapes = ", ".join(f"{name} {tuple(t.shape)}" for name, t in named)
            raise InvalidRequestError(
                f"flow inputs have shapes {shapes}; expected (B, N), (B, P), "
                f"(B, P_mel, {mel_bins}), (B, {self.cfg.spk_embed_dim})"
            )
        if token.is_floating_point() or prompt_token.is_floating_point():
            raise InvalidRequestError("flow speech tokens must be integers")
        tokens = token.shape[1] + prompt_token.shape[1] - (0 if finalize else self.pre_lookahead_len)
        if tokens < 1:
            raise InvalidRequestError(
                f"flow needs at least {1 if finalize else self.pre_lookahead_len + 1} tokens, "
                f"got {token.shape[1] + prompt_token.shape[1]}"
            )
        if prompt_feat.shape[1] > self.token_mel_ratio * tokens:
            raise InvalidRequestError(
                f"prompt mel has {prompt_feat.shape[1]} frames, more than the "
                f"{self.token_mel_ratio * tokens} frames of the tokens"
            )
        # An out-of-range id would be a device-side assert on GPU, which kills the process.
        largest = max((int(t.max()) for t in (token, prompt_token) if t.numel()), default=0)
        if largest >= self.cfg.vocab_size:
            raise InvalidRequestError(
                f"speech token {largest} is outside the vocabulary of {self.cfg.vocab_size}"
            )


def _key_value_bytes(module: nn.Module, dtype: torch.dtype) -> int:
    """Bytes of the keys and values cached per position in ``dtype`` by the attention
    layers under ``module``."""
    return sum(
        2 * layer.heads * row_bytes(layer.head_dim, dtype)
        for layer in module.modules()
        if isinstance(layer, RelPositionAttention | SelfAttention)
    )


def _input_bytes(module: nn.Module, dtype: torch.dtype) -> int:
    """Bytes of the inputs a compact cache keeps per position in ``dtype`` for the
    attention layers under ``module``."""
    return sum(row_bytes(layer.dim, dtype) for layer in module.modules() if isinstance(layer, SelfAttention))
