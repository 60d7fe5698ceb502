"""Write ``cosyvoice2.yaml`` in the official HyperPyYAML form for given hyperparameters, and
the parts ``cosyvoice3.yaml`` shares with it.

The text follows the released file's structure (the same keys, tags and references) so
that upstream's loader builds the same classes from it; only the geometry varies.
"""

from cosyserve.modeldir.hparams import CFMConfig, HiFTConfig, MelConfig, ModelHParams
from cosyserve.modeldir.hparams3 import Model3HParams


def yaml_list(values: tuple[int, ...] | tuple[tuple[int, ...], ...]) -> str:
    return "[" + ", ".join(yaml_list(v) if isinstance(v, tuple) else str(v) for v in values) + "]"


def render_yaml(hp: ModelHParams) -> str:
    """The text of ``cosyvoice2.yaml`` for ``hp``."""
    flow = hp.flow
    enc, est, cfm = flow.encoder, flow.estimator, flow.cfm
    return (
        header(hp)
        + model_heads(hp, "Qwen2LM", "CausalMaskedDiffWithXvec")
        + f"""\
    encoder: !new:cosyvoice.transformer.upsample_encoder.UpsampleConformerEncoder
        output_size: {enc.output_size}
        attention_heads: {enc.attention_heads}
        linear_units: {enc.linear_units}
        num_blocks: {enc.num_blocks}
        dropout_rate: 0.1
        positional_dropout_rate: 0.1
        attention_dropout_rate: 0.1
        normalize_before: True
        input_layer: 'linear'
        pos_enc_layer_type: 'rel_pos_espnet'
        selfattention_layer_type: 'rel_selfattn'
        input_size: {enc.input_size}
        use_cnn_module: False
        macaron_style: False
        static_chunk_size: !ref <chunk_size>
"""
        + cfm_head(cfm)
        + f"""\
        estimator: !new:cosyvoice.flow.decoder.CausalConditionalDecoder
            in_channels: {est.in_channels}
            out_channels: {est.out_channels}
            channels: {yaml_list(est.channels)}
            dropout: 0.0
            attention_head_dim: {est.attention_head_dim}
            n_blocks: {est.n_blocks}
            num_mid_blocks: {est.num_mid_blocks}
            num_heads: {est.num_heads}
            act_fn: '{est.act_fn}'
            static_chunk_size: !ref <chunk_size> * <token_mel_ratio>
            num_decoding_left_chunks: !ref <num_decoding_left_chunks>

"""
        + hift_section(hp.hift, "HiFTGenerator", "ConvRNNF0Predictor")
        + processors(hp.mel)
    )


def header(hp: ModelHParams | Model3HParams) -> str:
    """The seeds and the fixed parameters both families' yamls open with."""
    lm, flow = hp.lm, hp.flow
    chunk = hp.chunk_size if isinstance(hp, Model3HParams) else hp.flow.encoder.static_chunk_size
    return f"""# set random seed, so that you may reproduce your result.
__set_seed1: !apply:random.seed [1986]
__set_seed2: !apply:numpy.random.seed [1986]
__set_seed3: !apply:torch.manual_seed [1986]
__set_seed4: !apply:torch.cuda.manual_seed_all [1986]

# fixed params
sample_rate: {hp.sample_rate}
llm_input_size: {lm.llm_input_size}
llm_output_size: {lm.llm_output_size}
spk_embed_dim: {flow.spk_embed_dim}
qwen_pretrain_path: ''
token_frame_rate: {hp.token_frame_rate}
token_mel_ratio: {hp.token_mel_ratio}

# stream related params
chunk_size: {chunk} # streaming inference chunk size, in token
num_decoding_left_chunks: -1 # <0: all left chunks

"""


def model_heads(hp: ModelHParams | Model3HParams, lm_class: str, flow_class: str) -> str:
    """The ``llm`` section and the ``flow`` section's first arguments, the same in both
    families but for the class names."""
    lm, flow, s = hp.lm, hp.flow, hp.lm.sampling
    return f"""# model params
llm: !new:cosyvoice.llm.llm.{lm_class}
    llm_input_size: !ref <llm_input_size>
    llm_output_size: !ref <llm_output_size>
    speech_token_size: {lm.speech_token_size}
    length_normalized_loss: True
    lsm_weight: 0
    mix_ratio: [5, 15]
    llm: !new:cosyvoice.llm.llm.Qwen2Encoder
        pretrain_path: !ref <qwen_pretrain_path>
    sampling: !name:cosyvoice.utils.common.ras_sampling
        top_p: {s.top_p}
        top_k: {s.top_k}
        win_size: {s.win_size}
        tau_r: {s.tau_r}

flow: !new:cosyvoice.flow.flow.{flow_class}
    input_size: {flow.input_size}
    output_size: {flow.output_size}
    spk_embed_dim: !ref <spk_embed_dim>
    output_type: 'mel'
    vocab_size: {flow.vocab_size}
    input_frame_rate: !ref <token_frame_rate>
    only_mask_loss: True
    token_mel_ratio: !ref <token_mel_ratio>
    pre_lookahead_len: {flow.pre_lookahead_len}
"""


def cfm_head(cfm: CFMConfig) -> str:
    """The flow's ``decoder`` (the CFM) and its parameters, before its estimator."""
    return f"""    decoder: !new:cosyvoice.flow.flow_matching.CausalConditionalCFM
        in_channels: {cfm.in_channels}
        n_spks: 1
        spk_emb_dim: {cfm.spk_emb_dim}
        cfm_params: !new:omegaconf.DictConfig
            content:
                sigma_min: {cfm.sigma_min:g}
                solver: 'euler'
                t_scheduler: '{cfm.t_scheduler}'
                training_cfg_rate: 0.2
                inference_cfg_rate: {cfm.inference_cfg_rate}
                reg_loss_type: 'l1'
"""


def hift_section(hift: HiFTConfig, generator: str, f0_predictor: str, extra: str = "") -> str:
    """The ``hift`` section: ``generator`` and ``f0_predictor`` class names, ``extra``
    argument lines before the f0 predictor."""
    return f"""hift: !new:cosyvoice.hifigan.generator.{generator}
    in_channels: {hift.in_channels}
    base_channels: {hift.base_channels}
    nb_harmonics: {hift.nb_harmonics}
    sampling_rate: !ref <sample_rate>
    nsf_alpha: {hift.nsf_alpha}
    nsf_sigma: {hift.nsf_sigma}
    nsf_voiced_threshold: {hift.nsf_voiced_threshold:g}
    upsample_rates: {yaml_list(hift.upsample_rates)}
    upsample_kernel_sizes: {yaml_list(hift.upsample_kernel_sizes)}
    istft_params:
        n_fft: {hift.istft_n_fft}
        hop_len: {hift.istft_hop_len}
    resblock_kernel_sizes: {yaml_list(hift.resblock_kernel_sizes)}
    resblock_dilation_sizes: {yaml_list(hift.resblock_dilation_sizes)}
    source_resblock_kernel_sizes: {yaml_list(hift.source_resblock_kernel_sizes)}
    source_resblock_dilation_sizes: {yaml_list(hift.source_resblock_dilation_sizes)}
    lrelu_slope: {hift.lrelu_slope}
    audio_limit: {hift.audio_limit}
{extra}    f0_predictor: !new:cosyvoice.hifigan.f0_predictor.{f0_predictor}
        num_class: {hift.f0_num_class}
        in_channels: {hift.f0_in_channels}
        cond_channels: {hift.f0_cond_channels}

"""


def processors(mel: MelConfig, tokenizer_version: str = "") -> str:
    """The tokenizer and feature-extractor entries (``tokenizer_version``: CosyVoice 3's)."""
    fmax = "null" if mel.fmax is None else f"{mel.fmax:g}"
    version = f"\n    version: {tokenizer_version}" if tokenizer_version else ""
    return f"""# processor functions
get_tokenizer: !name:cosyvoice.tokenizer.tokenizer.get_qwen_tokenizer
    token_path: !ref <qwen_pretrain_path>
    skip_special_tokens: True{version}
allowed_special: 'all'
feat_extractor: !name:matcha.utils.audio.mel_spectrogram
    n_fft: {mel.n_fft}
    num_mels: {mel.num_mels}
    sampling_rate: !ref <sample_rate>
    hop_size: {mel.hop_size}
    win_size: {mel.win_size}
    fmin: {mel.fmin:g}
    fmax: {fmax}
    center: {mel.center}
"""
