import pytest

from cosyserve.errors import ModelDirError
from cosyserve.modeldir.hparams import FlowConfig, ModelHParams, hparams_from_yaml
from cosyserve.modeldir.presets import FULL, TINY
from cosyserve.modeldir.yamlread import Tagged, read_hyperpyyaml
from cosyserve.modeldir.yamlwrite import render_yaml


@pytest.mark.parametrize("preset", [TINY, FULL], ids=["tiny", "full"])
def test_rendered_yaml_reads_back_to_the_same_hparams(preset: ModelHParams) -> None:
    assert hparams_from_yaml(render_yaml(preset), preset.lm.qwen) == preset


def test_full_preset_is_the_released_geometry() -> None:
    hp = hparams_from_yaml(render_yaml(FULL), FULL.lm.qwen)
    assert hp.flow.encoder.static_chunk_size == 25
    assert hp.flow.estimator.static_chunk_size == 50
    assert hp.flow.estimator.channels == (256,)
    assert hp.hift.upsample_factor == 480
    assert hp.lm.stop_token_ids == (6561, 6562, 6563)
    assert hp.lm.qwen.head_dim == 64


def test_refs_with_arithmetic_and_tags_are_resolved() -> None:
    data = read_hyperpyyaml("a: 25\nb: 2\nc: !ref <a> * <b>\nd: !new:x.Y\n    k: !ref <c>\n")
    assert data["c"] == 50
    assert data["d"] == Tagged("new:x.Y", {"k": 50})


def test_ref_to_missing_key_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="does not exist"):
        read_hyperpyyaml("a: !ref <nope>\n")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("llm: 1\n", "no 'flow' section"),
        ("- a\n- b\n", "not valid HyperPyYAML"),
        ("llm: !new:a.B\n    x: [\n", "not valid HyperPyYAML"),
        ("llm: 3\nflow: 4\nhift: 5\n", "'llm' is not a class definition"),
    ],
)
def test_malformed_yaml_raises_model_dir_error(text: str, message: str) -> None:
    with pytest.raises(ModelDirError, match=message):
        hparams_from_yaml(text, FULL.lm.qwen)


def test_flow_defaults_match_upstream_constants() -> None:
    assert FlowConfig().pre_lookahead_len == 3
    assert FlowConfig().cfm.n_timesteps == 10
