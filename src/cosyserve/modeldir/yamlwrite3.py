"""Write ``cosyvoice3.yaml`` in the official HyperPyYAML form for given hyperparameters.

The text follows the released Fun-CosyVoice3-0.5B-2512 file's structure (the same keys,
tags and references) so that upstream's loader builds the same classes from it; only the
geometry varies. The training-only sections (discriminators, data pipeline) are left out:
upstream's inference never reads them.
"""

from cosyserve.modeldir.hparams3 import Model3HParams
from cosyserve.modeldir.yamlwrite import cfm_head, header, hift_section, model_heads, processors


def render_yaml3(hp: Model3HParams) -> str:
    """The text of ``cosyvoice3.yaml`` for ``hp``."""
    flow = hp.flow
    dit, cfm = flow.dit, flow.cfm
    return (
        header(hp)
        + model_heads(hp, "CosyVoice3LM", "CausalMaskedDiffWithDiT")
        + f"""\
    pre_lookahead_layer: !new:cosyvoice.transformer.upsample_encoder.PreLookaheadLayer
        in_channels: {flow.input_size}
        channels: {flow.pre_lookahead_channels}
        pre_lookahead_len: {flow.pre_lookahead_len}
"""
        + cfm_head(cfm)
        + f"""\
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
