"""Hyperparameters of a CosyVoice 2 model directory as frozen dataclasses.

Read from ``cosyvoice2.yaml`` (as data, see :mod:`cosyserve.modeldir.yamlread`) and
``CosyVoice-BlankEN/config.json``. Defaults are the released CosyVoice2-0.5B values.
"""

import json
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Protocol, TypeVar

from cosyserve.errors import ModelDirError
from cosyserve.modeldir.yamlread import Tagged, read_hyperpyyaml

T = TypeVar("T")


@dataclass(frozen=True)
class Qwen2Config:
    """The Qwen2 backbone geometry (``CosyVoice-BlankEN/config.json``)."""

    hidden_size: int = 896
    intermediate_size: int = 4864
    num_hidden_layers: int = 24
    num_attention_heads: int = 14
    num_key_value_heads: int = 2
    vocab_size: int = 151936
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = True

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


@dataclass(frozen=True)
class SamplingConfig:
    """Repetition-aware sampling (VALL-E 2) as configured by ``ras_sampling``."""

    top_p: float = 0.8
    top_k: int = 25
    win_size: int = 10
    tau_r: float = 0.1


@dataclass(frozen=True)
class LMConfig:
    qwen: Qwen2Config = field(default_factory=Qwen2Config)
    speech_token_size: int = 6561
    llm_input_size: int = 896
    llm_output_size: int = 896
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    # Hard-coded in upstream's Qwen2LM.inference: min/max speech tokens per text token.
    min_token_text_ratio: float = 2.0
    max_token_text_ratio: float = 20.0

    @property
    def num_speech_ids(self) -> int:
        """Rows of ``speech_embedding`` and of the speech head (6564)."""
        return self.speech_token_size + 3

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """eos (6561), the unused 6562 and fill (6563) all end generation."""
        return tuple(range(self.speech_token_size, self.num_speech_ids))

    @property
    def ids_masked_below_min_len(self) -> tuple[int, ...]:
        """What upstream's ``sampling_ids(ignore_eos=True)`` forbids below the minimum
        length: index ``speech_token_size``, here eos (6561)."""
        return (self.speech_token_size,)

    @property
    def fallback_bans_repeat(self) -> bool:
        """CosyVoice 2's reference (the PyPI package) redraws a too-repeated token from the
        whole distribution, the repeated token included (:mod:`cosyserve.models.sampling`)."""
        return False

    @property
    def silent_tokens(self) -> tuple[int, ...]:
        return ()

    @property
    def max_silent_run(self) -> int | None:
        """CosyVoice 2 passes every sampled token to the flow."""
        return None


class SpeechLMConfig(Protocol):
    """What the engine, the sampler and the shared LM code read of an LM's configuration;
    :class:`LMConfig` (CosyVoice 2) and ``hparams3.LM3Config`` (CosyVoice 3) both provide it."""

    @property
    def qwen(self) -> Qwen2Config: ...
    @property
    def speech_token_size(self) -> int: ...
    @property
    def llm_input_size(self) -> int: ...
    @property
    def llm_output_size(self) -> int: ...
    @property
    def sampling(self) -> SamplingConfig: ...
    @property
    def min_token_text_ratio(self) -> float: ...
    @property
    def max_token_text_ratio(self) -> float: ...
    @property
    def num_speech_ids(self) -> int: ...
    @property
    def stop_token_ids(self) -> tuple[int, ...]: ...
    @property
    def ids_masked_below_min_len(self) -> tuple[int, ...]: ...
    @property
    def fallback_bans_repeat(self) -> bool: ...
    @property
    def silent_tokens(self) -> tuple[int, ...]: ...
    @property
    def max_silent_run(self) -> int | None: ...


@dataclass(frozen=True)
class EncoderConfig:
    """``UpsampleConformerEncoder``. Upstream hard-codes the 512-wide pre-lookahead and
    upsample layers and the 4 ``up_encoders``, so ``output_size`` must be 512."""

    input_size: int = 512
    output_size: int = 512
    attention_heads: int = 8
    linear_units: int = 2048
    num_blocks: int = 6
    num_up_blocks: int = 4
    static_chunk_size: int = 25
    upsample_stride: int = 2


@dataclass(frozen=True)
class EstimatorConfig:
    """``CausalConditionalDecoder``, the flow-matching vector field."""

    in_channels: int = 320
    out_channels: int = 80
    channels: tuple[int, ...] = (256,)
    attention_head_dim: int = 64
    n_blocks: int = 4
    num_mid_blocks: int = 12
    num_heads: int = 8
    act_fn: str = "gelu"
    static_chunk_size: int = 50


@dataclass(frozen=True)
class CFMConfig:
    """``CausalConditionalCFM``. ``n_timesteps`` is the value upstream's flow passes."""

    in_channels: int = 240
    spk_emb_dim: int = 80
    sigma_min: float = 1e-6
    t_scheduler: str = "cosine"
    inference_cfg_rate: float = 0.7
    n_timesteps: int = 10


@dataclass(frozen=True)
class FlowConfig:
    input_size: int = 512
    output_size: int = 80
    spk_embed_dim: int = 192
    vocab_size: int = 6561
    input_frame_rate: int = 25
    token_mel_ratio: int = 2
    pre_lookahead_len: int = 3
    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    cfm: CFMConfig = field(default_factory=CFMConfig)
    estimator: EstimatorConfig = field(default_factory=EstimatorConfig)


@dataclass(frozen=True)
class HiFTConfig:
    in_channels: int = 80
    base_channels: int = 512
    nb_harmonics: int = 8
    sampling_rate: int = 24000
    nsf_alpha: float = 0.1
    nsf_sigma: float = 0.003
    nsf_voiced_threshold: float = 10.0
    upsample_rates: tuple[int, ...] = (8, 5, 3)
    upsample_kernel_sizes: tuple[int, ...] = (16, 11, 7)
    istft_n_fft: int = 16
    istft_hop_len: int = 4
    resblock_kernel_sizes: tuple[int, ...] = (3, 7, 11)
    resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    source_resblock_kernel_sizes: tuple[int, ...] = (7, 7, 11)
    source_resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    lrelu_slope: float = 0.1
    audio_limit: float = 0.99
    f0_num_class: int = 1
    f0_in_channels: int = 80
    f0_cond_channels: int = 512

    @property
    def upsample_factor(self) -> int:
        """Waveform samples per mel frame (480 for the released model)."""
        total = self.istft_hop_len
        for rate in self.upsample_rates:
            total *= rate
        return total


@dataclass(frozen=True)
class MelConfig:
    """The prompt-mel extractor (``feat_extractor``: Matcha's ``mel_spectrogram``)."""

    n_fft: int = 1920
    num_mels: int = 80
    sampling_rate: int = 24000
    hop_size: int = 480
    win_size: int = 1920
    fmin: float = 0.0
    fmax: float | None = 8000.0
    center: bool = False


@dataclass(frozen=True)
class ModelHParams:
    sample_rate: int = 24000
    token_frame_rate: int = 25
    token_mel_ratio: int = 2
    lm: LMConfig = field(default_factory=LMConfig)
    flow: FlowConfig = field(default_factory=FlowConfig)
    hift: HiFTConfig = field(default_factory=HiFTConfig)
    mel: MelConfig = field(default_factory=MelConfig)


def section_args(node: Any, name: str) -> dict[str, Any]:
    if not isinstance(node, Tagged) or not isinstance(node.args, dict):
        raise ModelDirError(f"'{name}' is not a class definition with arguments")
    return node.args


def pick_fields(args: dict[str, Any], cls: type) -> dict[str, Any]:
    """Keep the plain (untagged, non-mapping) yaml arguments that are fields of ``cls``.

    Nested sections are built separately, so tagged and mapping values are skipped.
    """
    names = {f.name for f in fields(cls)}
    out: dict[str, Any] = {}
    for key, value in args.items():
        if key in names and not isinstance(value, Tagged | dict):
            out[key] = _tuplify(value)
    return out


def _tuplify(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_tuplify(v) for v in value)
    return value


def qwen2_config_from_json(path: Path) -> Qwen2Config:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelDirError(f"{path}: cannot read the Qwen2 config ({exc.__class__.__name__})") from None
    if not isinstance(data, dict):
        raise ModelDirError(f"{path}: not a JSON object")
    return Qwen2Config(**pick_fields(data, Qwen2Config))


def hparams_from_yaml(text: str, qwen: Qwen2Config) -> ModelHParams:
    """Build :class:`ModelHParams` from the text of ``cosyvoice2.yaml``."""
    return parse_model_yaml(text, "cosyvoice2.yaml", lambda top: _hparams(top, qwen))


def parse_model_yaml(text: str, file: str, build: Callable[[dict[str, Any]], T]) -> T:
    """Read a model yaml as data and ``build`` its hyperparameters from the top-level
    sections; every problem is a :class:`ModelDirError` naming ``file``."""
    try:
        top = read_hyperpyyaml(text)
    except Exception as exc:  # yaml.YAMLError, ValueError: both mean a malformed file
        raise ModelDirError(f"{file} is not valid HyperPyYAML: {exc}") from None
    for key in ("llm", "flow", "hift"):
        if key not in top:
            raise ModelDirError(f"{file} has no '{key}' section")
    try:
        return build(top)
    except ModelDirError as exc:
        raise ModelDirError(f"{file}: {exc}") from None
    except (TypeError, ValueError) as exc:
        raise ModelDirError(f"{file} has an invalid value: {exc}") from None


def _hparams(top: dict[str, Any], qwen: Qwen2Config) -> ModelHParams:
    llm = section_args(top["llm"], "llm")
    flow_args = section_args(top["flow"], "flow")
    decoder = section_args(flow_args.get("decoder"), "flow.decoder")
    flow = FlowConfig(
        encoder=EncoderConfig(
            **pick_fields(section_args(flow_args.get("encoder"), "flow.encoder"), EncoderConfig)
        ),
        cfm=cfm_config(decoder),
        estimator=EstimatorConfig(
            **pick_fields(section_args(decoder.get("estimator"), "flow.decoder.estimator"), EstimatorConfig)
        ),
        **pick_fields(flow_args, FlowConfig),
    )
    return ModelHParams(
        lm=LMConfig(qwen=qwen, sampling=sampling_config(llm), **pick_fields(llm, LMConfig)),
        flow=flow,
        hift=HiFTConfig(**pick_fields(hift_values(section_args(top["hift"], "hift")), HiFTConfig)),
        mel=mel_config(top),
        **pick_fields(top, ModelHParams),
    )


def sampling_config(llm: dict[str, Any]) -> SamplingConfig:
    """The ``sampling`` (``ras_sampling``) arguments of an ``llm`` section."""
    sampling = llm.get("sampling")
    if isinstance(sampling, Tagged) and isinstance(sampling.args, dict):
        return SamplingConfig(**pick_fields(sampling.args, SamplingConfig))
    return SamplingConfig()


def cfm_config(decoder: dict[str, Any]) -> CFMConfig:
    """A ``flow.decoder`` section with its ``cfm_params`` (an omegaconf ``DictConfig``) merged in."""
    values = dict(decoder)
    cfm_params = decoder.get("cfm_params")
    if isinstance(cfm_params, Tagged) and isinstance(cfm_params.args, dict):
        values.update(cfm_params.args.get("content", cfm_params.args))
    return CFMConfig(**pick_fields(values, CFMConfig))


def hift_values(hift_args: dict[str, Any]) -> dict[str, Any]:
    """A ``hift`` section flattened to :class:`HiFTConfig` names (``istft_*``, ``f0_*``)."""
    values = dict(hift_args)
    istft = hift_args.get("istft_params", {})
    values.update({"istft_n_fft": istft.get("n_fft", 16), "istft_hop_len": istft.get("hop_len", 4)})
    f0 = hift_args.get("f0_predictor")
    if isinstance(f0, Tagged) and isinstance(f0.args, dict):
        values.update({f"f0_{k}": v for k, v in f0.args.items()})
    return values


def mel_config(top: dict[str, Any]) -> MelConfig:
    mel_args = top.get("feat_extractor")
    if isinstance(mel_args, Tagged) and isinstance(mel_args.args, dict):
        return MelConfig(**pick_fields(mel_args.args, MelConfig))
    return MelConfig()
