"""Geometry presets for generated model directories.

``FULL`` is the released CosyVoice2-0.5B geometry (the dataclass defaults), ``FULL3`` the
released Fun-CosyVoice3-0.5B-2512 one. ``TINY`` is
for tests: every dimension small except those upstream hard-codes (the flow encoder's
512 width, the 4 up-encoders, 80 mel bins) and the Qwen2 vocabulary, whose special
tokens must keep their official ids. ``TINY3`` is the same for CosyVoice 3 (the DiT
width stays a multiple of 16, the groups of its positional convolution).
"""

from cosyserve.modeldir.hparams import (
    EncoderConfig,
    EstimatorConfig,
    FlowConfig,
    HiFTConfig,
    LMConfig,
    ModelHParams,
    Qwen2Config,
)
from cosyserve.modeldir.hparams3 import DiTConfig, Flow3Config, HiFT3Config, LM3Config, Model3HParams

FULL = ModelHParams()

_TINY_QWEN = Qwen2Config(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
)

TINY = ModelHParams(
    lm=LMConfig(qwen=_TINY_QWEN, llm_input_size=64, llm_output_size=64),
    flow=FlowConfig(
        encoder=EncoderConfig(attention_heads=4, linear_units=64, num_blocks=1),
        estimator=EstimatorConfig(
            channels=(32,), attention_head_dim=16, n_blocks=1, num_mid_blocks=2, num_heads=2
        ),
    ),
    hift=HiFTConfig(base_channels=32, f0_cond_channels=32),
)

PRESETS = {"tiny": TINY, "full": FULL}

FULL3 = Model3HParams()

TINY3 = Model3HParams(
    lm=LM3Config(qwen=_TINY_QWEN, llm_input_size=64, llm_output_size=64),
    flow=Flow3Config(
        pre_lookahead_channels=32,
        dit=DiTConfig(dim=64, depth=2, heads=2, dim_head=32),
    ),
    hift=HiFT3Config(base_channels=32, f0_cond_channels=32),
)

PRESETS3 = {"tiny": TINY3, "full": FULL3}
