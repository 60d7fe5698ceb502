"""Write ``cosyvoice3.yaml`` in the official HyperPyYAML form for given hyperparameters.

The text follows the released Fun-CosyVoice3-0.5B-2512 file's structure (the same keys,
tags and references) so that upstream's loader builds the same classes from it; only the
geometry varies. The training-only sections (discriminators, data pipeline) are left out:
upstream's inference never reads them.
"""

from cosyserve.modeldir.hparams3 import Model3HParams
from cosyserve.modeldir.yamlwrite import yaml_list


def render_yaml3(hp: Model3HParams) -> str:
    """The text of ``cosyvoice3.yaml`` for ``hp``."""
    lm, flow, hift, mel = hp.lm, hp.flow, hp.hift, hp.mel
    dit, cfm, s = flow.dit, flow.cfm, lm.sampling
    fmax = "null" if mel.fmax is None else f"{mel.fmax:g}"
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
chunk_size: {hp.chunk_size} # streaming inference chunk size, in token
num_decoding_left_chunks: {dit.num_decoding_left_chunks} # <0: all left chunks

# model params
llm: !new:cosyvoice.llm.llm.CosyVoice3LM
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

flow: !new:cosyvoice.flow.flow.CausalMaskedDiffWithDiT
    input_size: {flow.input_size}
    output_size: {flow.output_size}
    spk_embed_dim: !ref <spk_embed_dim>
    output_type: 'mel'
    vocab_size: {flow.vocab_size}
    input_frame_rate: !ref <token_frame_rate>
    only_mask_loss: True
    token_mel_ratio: !ref <token_mel_ratio>
    pre_lookahead_len: {flow.pre_lookahead_len}
    pre_lookahead_layer: !new:cosyvoice.transformer.upsample_encoder.PreLookaheadLayer
        in_channels: {flow.input_size}
        channels: {flow.pre_lookahead_channels}
        pre_lookahead_len: {flow.pre_lookahead_len}
    decoder: !new:cosyvoice.flow.flow_matching.CausalConditionalCFM
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
        estimator: !new:cosyvoice.flow.DiT.dit.DiT
            dim: {dit.dim}
            depth: {dit.depth}
            heads: {dit.heads}
            dim_head: {dit.dim_head}
            ff_mult: {dit.ff_mult}
            mel_dim: {dit.mel_dim}
            mu_dim: {dit.mu_dim}
            spk_dim: {dit.spk_dim}
            out_channels: {dit.out_channels}
            static_chunk_size: !ref <chunk_size> * <token_mel_ratio>
            num_decoding_left_chunks: !ref <num_decoding_left_chunks>

hift: !new:cosyvoice.hifigan.generator.CausalHiFTGenerator
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
    conv_pre_look_right: {hift.conv_pre_look_right}
    f0_predictor: !new:cosyvoice.hifigan.f0_predictor.CausalConvRNNF0Predictor
        num_class: {hift.f0_num_class}
        in_channels: {hift.f0_in_channels}
        cond_channels: {hift.f0_cond_channels}

# processor functions
get_tokenizer: !name:cosyvoice.tokenizer.tokenizer.get_qwen_tokenizer
    token_path: !ref <qwen_pretrain_path>
    skip_special_tokens: True
    version: cosyvoice3
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
