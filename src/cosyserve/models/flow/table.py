"""The checked mapping between the official ``flow.pt`` (upstream
``CausalMaskedDiffWithXvec.state_dict()``) and :class:`~cosyserve.models.flow.flow.Flow`."""

from cosyserve.modeldir.hparams import FlowConfig
from cosyserve.weights.checkpoint import CheckpointTable

_WB = ("weight", "bias")
_Pairs = list[tuple[str, str]]


def _linear(pairs: _Pairs, ckpt: str, ours: str, names: tuple[str, ...] = _WB) -> None:
    """Map ``ckpt.<name>`` to ``ours.<name>`` for each parameter name."""
    pairs.extend((f"{ckpt}.{name}", f"{ours}.{name}") for name in names)


def _conformer_layer(pairs: _Pairs, ckpt: str, ours: str) -> None:
    attn, our_attn = f"{ckpt}.self_attn", f"{ours}.attn"
    for theirs, mine in (("linear_q", "q"), ("linear_k", "k"), ("linear_v", "v"), ("linear_out", "out")):
        _linear(pairs, f"{attn}.{theirs}", f"{our_attn}.{mine}")
    _linear(pairs, f"{attn}.linear_pos", f"{our_attn}.pos", ("weight",))
    pairs.append((f"{attn}.pos_bias_u", f"{our_attn}.content_bias"))
    pairs.append((f"{attn}.pos_bias_v", f"{our_attn}.position_bias"))
    _linear(pairs, f"{ckpt}.feed_forward.w_1", f"{ours}.ff.w1")
    _linear(pairs, f"{ckpt}.feed_forward.w_2", f"{ours}.ff.w2")
    _linear(pairs, f"{ckpt}.norm_mha", f"{ours}.attn_norm")
    _linear(pairs, f"{ckpt}.norm_ff", f"{ours}.ff_norm")


def _encoder(pairs: _Pairs, cfg: FlowConfig) -> None:
    for embed in ("embed", "up_embed"):
        _linear(pairs, f"encoder.{embed}.out.0", f"encoder.{embed}.linear")
        _linear(pairs, f"encoder.{embed}.out.1", f"encoder.{embed}.norm")
    _linear(pairs, "encoder.pre_lookahead_layer.conv1", "encoder.lookahead.conv1")
    _linear(pairs, "encoder.pre_lookahead_layer.conv2", "encoder.lookahead.conv2")
    _linear(pairs, "encoder.up_layer.conv", "encoder.upsample.conv")
    _linear(pairs, "encoder.after_norm", "encoder.final_norm")
    for i in range(cfg.encoder.num_blocks):
        _conformer_layer(pairs, f"encoder.encoders.{i}", f"encoder.layers.{i}")
    for i in range(cfg.encoder.num_up_blocks):
        _conformer_layer(pairs, f"encoder.up_encoders.{i}", f"encoder.up_layers.{i}")


def _causal_block(pairs: _Pairs, ckpt: str, ours: str) -> None:
    # Upstream's block is Sequential(conv, transpose, LayerNorm, transpose, Mish).
    _linear(pairs, f"{ckpt}.block.0", f"{ours}.conv")
    _linear(pairs, f"{ckpt}.block.2", f"{ours}.norm")


def _stage(pairs: _Pairs, ckpt: str, ours: str, n_blocks: int) -> None:
    """An upstream ``[resnet, transformer_blocks, ...]`` ModuleList (``ckpt``) -> our Stage."""
    resnet, our_resnet = f"{ckpt}.0", f"{ours}.resnet"
    _linear(pairs, f"{resnet}.mlp.1", f"{our_resnet}.time_proj")
    _causal_block(pairs, f"{resnet}.block1", f"{our_resnet}.block1")
    _causal_block(pairs, f"{resnet}.block2", f"{our_resnet}.block2")
    _linear(pairs, f"{resnet}.res_conv", f"{our_resnet}.res_conv")
    for j in range(n_blocks):
        block, our_block = f"{ckpt}.1.{j}", f"{ours}.transformers.{j}"
        _linear(pairs, f"{block}.norm1", f"{our_block}.attn_norm")
        for name in ("q", "k", "v"):
            _linear(pairs, f"{block}.attn1.to_{name}", f"{our_block}.attn.{name}", ("weight",))
        _linear(pairs, f"{block}.attn1.to_out.0", f"{our_block}.attn.out")
        _linear(pairs, f"{block}.norm3", f"{our_block}.ff_norm")
        _linear(pairs, f"{block}.ff.net.0.proj", f"{our_block}.ff_in")
        _linear(pairs, f"{block}.ff.net.2", f"{our_block}.ff_out")


def _estimator(pairs: _Pairs, cfg: FlowConfig) -> None:
    est, ours, n_blocks = "decoder.estimator", "cfm.estimator", cfg.estimator.n_blocks
    _linear(pairs, f"{est}.time_mlp.linear_1", f"{ours}.time_mlp.linear1")
    _linear(pairs, f"{est}.time_mlp.linear_2", f"{ours}.time_mlp.linear2")
    _stage(pairs, f"{est}.down_blocks.0", f"{ours}.down", n_blocks)
    _linear(pairs, f"{est}.down_blocks.0.2", f"{ours}.down_conv")
    for i in range(cfg.estimator.num_mid_blocks):
        _stage(pairs, f"{est}.mid_blocks.{i}", f"{ours}.mid.{i}", n_blocks)
    _stage(pairs, f"{est}.up_blocks.0", f"{ours}.up", n_blocks)
    _linear(pairs, f"{est}.up_blocks.0.2", f"{ours}.up_conv")
    _causal_block(pairs, f"{est}.final_block", f"{ours}.final_block")
    _linear(pairs, f"{est}.final_proj", f"{ours}.final_proj")


def flow_checkpoint_table(cfg: FlowConfig) -> CheckpointTable:
    """Every key of ``flow.pt`` for geometry ``cfg`` and the :class:`Flow` key it fills."""
    pairs: _Pairs = []
    _linear(pairs, "input_embedding", "token_embedding", ("weight",))
    _linear(pairs, "spk_embed_affine_layer", "speaker_proj")
    _encoder(pairs, cfg)
    _linear(pairs, "encoder_proj", "mu_proj")
    _estimator(pairs, cfg)
    return CheckpointTable(file="flow.pt", entries=tuple(pairs))
