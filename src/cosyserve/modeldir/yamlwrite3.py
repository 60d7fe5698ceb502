"""Write ``cosyvoice3.yaml`` in the official HyperPyYAML form for given hyperparameters.

The text follows the released Fun-CosyVoice3-0.5B-2512 file's structure (the same keys,
tags and references) so that upstream's loader builds the same classes from it; only the
geometry varies. The training-only sections (discriminators, data pipeline) are left out:
upstream's inference never reads them.
"""

from cosyserve.modeldir.hparams3 import Model3HParams
from cosyserve.modeldir.yamlwrite import header, hift_section, processors


def render_yaml3(hp: Model3HParams) -> str:
    """The text of ``cosyvoice3.yaml`` for ``hp``."""
    lm, flow = hp.lm, hp.flow
    dit, cfm, s = flow.dit, flow.cfm, lm.sampling
    return (
        header(hp)
        + f"""# model params
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

"""
        + hift_section(
            hp.hift,
            "CausalHiFTGenerator",
            "CausalConvRNNF0Predictor",
            f"    conv_pre_look_right: {hp.hift.conv_pre_look_right}\n",
        )
        + processors(hp.mel, "cosyvoice3")
    )
