"""Hyperparameters of a Fun-CosyVoice3 model directory as frozen dataclasses.

Read from ``cosyvoice3.yaml`` (as data) and ``CosyVoice-BlankEN/config.json``. Defaults
are the released Fun-CosyVoice3-0.5B-2512 values. The Qwen2 backbone, the sampling, the
flow-matching solver, the mel extractor and most of the vocoder are CosyVoice 2's and
reuse its dataclasses; what CosyVoice 3 changes has its own.
"""

from dataclasses import dataclass, field
from typing import Any

from cosyserve.modeldir.family import YAML3_FILE
from cosyserve.modeldir.hparams import (
    CFMConfig,
    HiFTConfig,
    LMConfig,
    MelConfig,
    Qwen2Config,
    cfm_config,
    hift_values,
    mel_config,
    parse_model_yaml,
    pick_fields,
    sampling_config,
    section_args,
)

# Upstream's CosyVoice3LM reserves 200 ids after the speech codes: sos, eos, task_id and
# fill first, the rest unused; sampling any of them ends generation.
EXTRA_SPEECH_IDS = 200
# FSQ codes of silence and breath, as upstream's CosyVoice3Model lists them.
SILENT_TOKENS = (1, 2, 28, 29, 55, 248, 494, 2241, 2242, 2322, 2323)


@dataclass(frozen=True)
class LM3Config(LMConfig):
    """``CosyVoice3LM``: CosyVoice 2's fields (the Qwen2 body, sampling, length ratios) with
    one speech vocabulary holding the special ids, and upstream ace7c47's sampling rules."""

    @property
    def num_speech_ids(self) -> int:
        """Rows of ``speech_embedding`` and of the bias-free head (6761)."""
        return self.speech_token_size + EXTRA_SPEECH_IDS

    @property
    def sos(self) -> int:
        return self.speech_token_size

    @property
    def eos(self) -> int:
        return self.speech_token_size + 1

    @property
    def task_id(self) -> int:
        return self.speech_token_size + 2

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Every id from 6561 on ends generation."""
        return tuple(range(self.speech_token_size, self.num_speech_ids))

    @property
    def ids_masked_below_min_len(self) -> tuple[int, ...]:
        """What upstream's ``sampling_ids(ignore_eos=True)`` forbids below the minimum
        length. It masks index ``speech_token_size`` for both models, which in CosyVoice 3
        is sos (6561), not eos (6562): eos and the other stop ids stay allowed, as upstream."""
        return (self.speech_token_size,)

    @property
    def fallback_bans_repeat(self) -> bool:
        """Upstream at ace7c47, CosyVoice 3's reference, bans the repeated token from the redraw."""
        return True

    @property
    def silent_tokens(self) -> tuple[int, ...]:
        """The speech codes of silence and breath (upstream's ``CosyVoice3Model.silent_tokens``)."""
        return SILENT_TOKENS

    @property
    def max_silent_run(self) -> int | None:
        """Upstream passes at most 5 silent tokens in a row to the flow: longer pauses are cut."""
        return 5


@dataclass(frozen=True)
class DiTConfig:
    """The DiT estimator (``cosyvoice.flow.DiT.dit.DiT``). Chunk-causal in streaming with
    ``static_chunk_size`` mel frames (25 tokens x 2)."""

    dim: int = 1024
    depth: int = 22
    heads: int = 16
    dim_head: int = 64
    ff_mult: int = 2
    mel_dim: int = 80
    mu_dim: int = 80
    spk_dim: int = 80
    out_channels: int = 80
    static_chunk_size: int = 50
    num_decoding_left_chunks: int = -1
    long_skip_connection: bool = False


@dataclass(frozen=True)
class Flow3Config:
    """``CausalMaskedDiffWithDiT``: token embedding, pre-look-ahead convolutions, DiT CFM."""

    input_size: int = 80
    output_size: int = 80
    spk_embed_dim: int = 192
    vocab_size: int = 6561
    input_frame_rate: int = 25
    token_mel_ratio: int = 2
    pre_lookahead_len: int = 3
    pre_lookahead_channels: int = 1024
    cfm: CFMConfig = field(default_factory=CFMConfig)
    dit: DiTConfig = field(default_factory=DiTConfig)


@dataclass(frozen=True)
class HiFT3Config(HiFTConfig):
    """``CausalHiFTGenerator`` with ``CausalConvRNNF0Predictor``: CosyVoice 2's vocoder
    geometry, made causal, with ``conv_pre_look_right`` mel frames of look-ahead."""

    conv_pre_look_right: int = 4


@dataclass(frozen=True)
class Model3HParams:
    sample_rate: int = 24000
    token_frame_rate: int = 25
    token_mel_ratio: int = 2
    chunk_size: int = 25
    lm: LM3Config = field(default_factory=LM3Config)
    flow: Flow3Config = field(default_factory=Flow3Config)
    hift: HiFT3Config = field(default_factory=HiFT3Config)
    mel: MelConfig = field(default_factory=lambda: MelConfig(fmax=None))


def hparams3_from_yaml(text: str, qwen: Qwen2Config) -> Model3HParams:
    """Build :class:`Model3HParams` from the text of ``cosyvoice3.yaml``."""
    return parse_model_yaml(text, YAML3_FILE, lambda top: _hparams3(top, qwen))


def _hparams3(top: dict[str, Any], qwen: Qwen2Config) -> Model3HParams:
    llm = section_args(top["llm"], "llm")
    flow_args = section_args(top["flow"], "flow")
    decoder = section_args(flow_args.get("decoder"), "flow.decoder")
    estimator = section_args(decoder.get("estimator"), "flow.decoder.estimator")
    lookahead = section_args(flow_args.get("pre_lookahead_layer"), "flow.pre_lookahead_layer")
    flow = Flow3Config(
        pre_lookahead_channels=lookahead.get("channels", Flow3Config.pre_lookahead_channels),
        cfm=cfm_config(decoder),
        dit=DiTConfig(**pick_fields(estimator, DiTConfig)),
        **pick_fields(flow_args, Flow3Config),
    )
    return Model3HParams(
        lm=LM3Config(qwen=qwen, sampling=sampling_config(llm), **pick_fields(llm, LM3Config)),
        flow=flow,
        hift=HiFT3Config(**pick_fields(hift_values(section_args(top["hift"], "hift")), HiFT3Config)),
        mel=mel_config(top),
        **pick_fields(top, Model3HParams),
    )
