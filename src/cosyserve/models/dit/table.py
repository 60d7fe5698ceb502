"""The checked mapping between the official ``flow.pt`` (upstream
``CausalMaskedDiffWithDiT.state_dict()``) and :class:`~cosyserve.models.dit.flow3.Flow3`."""

from cosyserve.modeldir.hparams3 import Flow3Config
from cosyserve.weights.checkpoint import CheckpointTable

_WB = ("weight", "bias")
_Pairs = list[tuple[str, str]]


def _linear(pairs: _Pairs, ckpt: str, ours: str, names: tuple[str, ...] = _WB) -> None:
    """Map ``ckpt.<name>`` to ``ours.<name>`` for each parameter name."""
    pairs.extend((f"{ckpt}.{name}", f"{ours}.{name}") for name in names)


def _estimator(pairs: _Pairs, cfg: Flow3Config) -> None:
    est, ours = "decoder.estimator", "cfm.estimator"
    _linear(pairs, f"{est}.time_embed.time_mlp.0", f"{ours}.time_embed.linear1")
    _linear(pairs, f"{est}.time_embed.time_mlp.2", f"{ours}.time_embed.linear2")
    _linear(pairs, f"{est}.input_embed.proj", f"{ours}.input_embed.proj")
    _linear(pairs, f"{est}.input_embed.conv_pos_embed.conv1.0", f"{ours}.input_embed.pos_conv1")
    _linear(pairs, f"{est}.input_embed.conv_pos_embed.conv2.0", f"{ours}.input_embed.pos_conv2")
    # x-transformers registers the rotary frequencies as a persistent buffer.
    pairs.append((f"{est}.rotary_embed.inv_freq", f"{ours}.rotary.inv_freq"))
    for i in range(cfg.dit.depth):
        block, our_block = f"{est}.transformer_blocks.{i}", f"{ours}.blocks.{i}"
        _linear(pairs, f"{block}.attn_norm.linear", f"{our_block}.modulation.linear")
        for theirs, mine in (("to_q", "q"), ("to_k", "k"), ("to_v", "v"), ("to_out.0", "out")):
            _linear(pairs, f"{block}.attn.{theirs}", f"{our_block}.attn.{mine}")
        _linear(pairs, f"{block}.ff.ff.0.0", f"{our_block}.ff_in")
        _linear(pairs, f"{block}.ff.ff.2", f"{our_block}.ff_out")
    _linear(pairs, f"{est}.norm_out.linear", f"{ours}.norm_out.linear")
    _linear(pairs, f"{est}.proj_out", f"{ours}.proj_out")


def flow3_checkpoint_table(cfg: Flow3Config) -> CheckpointTable:
    """Every key of the CosyVoice 3 ``flow.pt`` for geometry ``cfg`` and the :class:`Flow3`
    key it fills."""
    pairs: _Pairs = []
    _linear(pairs, "input_embedding", "token_embedding", ("weight",))
    _linear(pairs, "spk_embed_affine_layer", "speaker_proj")
    _linear(pairs, "pre_lookahead_layer.conv1", "lookahead.conv1")
    _linear(pairs, "pre_lookahead_layer.conv2", "lookahead.conv2")
    _estimator(pairs, cfg)
    return CheckpointTable(file="flow.pt", entries=tuple(pairs))
