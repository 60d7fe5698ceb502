import hashlib
import json
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch
from safetensors.torch import load_file

from cosyserve.errors import ModelDirError
from cosyserve.modeldir import onnx_models
from cosyserve.modeldir.family import Family
from cosyserve.modeldir.layout import MANIFEST_FILE, QWEN_DIR, ModelDir
from cosyserve.modeldir.presets import FULL, TINY, TINY3
from cosyserve.models import generate
from cosyserve.models.flow.flow import Flow, flow_checkpoint_table
from cosyserve.models.generate import init_model_dir
from cosyserve.models.hift.generator import HiFTGenerator, hift_checkpoint_table
from cosyserve.models.lm import CosyVoice2LM, lm_checkpoint_table
from cosyserve.weights.checkpoint import load_checkpoint, read_state_dict
from tests.upstream import load_yaml_sections


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_same_seed_gives_byte_identical_directories(tiny_model_dir: Path, tmp_path: Path) -> None:
    init_model_dir(tmp_path / "again", "tiny", seed=0)
    first, second = _files(tiny_model_dir), _files(tmp_path / "again")
    assert sorted(first) == sorted(second)
    for name in first:
        assert first[name] == second[name], name


def test_other_seed_gives_other_weights(tiny_model_dir: Path, tmp_path: Path) -> None:
    init_model_dir(tmp_path / "other", "tiny", seed=1)
    for name in ("llm.pt", "flow.pt", "hift.pt", "campplus.onnx", "speech_tokenizer_v2.onnx", "spk2info.pt"):
        assert (tmp_path / "other" / name).read_bytes() != (tiny_model_dir / name).read_bytes(), name
    # The tokenizer does not depend on the seed.
    vocab = f"{QWEN_DIR}/vocab.json"
    assert (tmp_path / "other" / vocab).read_bytes() == (tiny_model_dir / vocab).read_bytes()


def test_manifest_lists_every_other_file_with_its_sha256(tiny_model_dir: Path) -> None:
    lines = (tiny_model_dir / MANIFEST_FILE).read_text(encoding="utf-8").splitlines()
    listed = {name: digest for digest, name in (line.split("  ") for line in lines)}
    assert list(listed) == sorted(listed)
    files = _files(tiny_model_dir)
    del files[MANIFEST_FILE]
    assert listed == {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}


def test_directory_is_world_readable(tiny_model_dir: Path) -> None:
    for path in [tiny_model_dir, *tiny_model_dir.rglob("*")]:
        assert path.stat().st_mode & 0o777 == (0o755 if path.is_dir() else 0o644), path


def test_refuses_non_empty_directory_without_force(tmp_path: Path) -> None:
    target = tmp_path / "dir"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    with pytest.raises(ModelDirError, match="is not empty; pass force"):
        init_model_dir(target, "tiny", seed=0)
    assert (target / "keep.txt").read_text() == "mine"


def test_force_replaces_and_empty_directory_is_used(tmp_path: Path) -> None:
    target = tmp_path / "dir"
    target.mkdir()
    init_model_dir(target, "tiny", seed=0)
    (target / "stale.txt").write_text("old")
    init_model_dir(target, "tiny", seed=0, force=True)
    assert not (target / "stale.txt").exists()
    ModelDir.open(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir"]


def test_file_target_and_unknown_size_are_refused(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(ModelDirError, match="exists and is not a directory"):
        init_model_dir(tmp_path / "file", "tiny", seed=0, force=True)
    with pytest.raises(ModelDirError, match="unknown model size 'huge'"):
        init_model_dir(tmp_path / "x", "huge", seed=0)


def test_interrupted_init_leaves_nothing_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted(*_: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(generate, "write_qwen_weights", interrupted)
    with pytest.raises(KeyboardInterrupt):
        init_model_dir(tmp_path / "dir", "tiny", seed=0)
    assert list(tmp_path.iterdir()) == []


def test_qwen_files(tiny_model_dir: Path) -> None:
    qwen = tiny_model_dir / QWEN_DIR
    config = json.loads((qwen / "config.json").read_text(encoding="utf-8"))
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert config["model_type"] == "qwen2"
    assert config["hidden_size"] == TINY.lm.qwen.hidden_size
    assert config["vocab_size"] == 151936
    assert config["tie_word_embeddings"] is True
    assert config["use_sliding_window"] is False
    assert config["torch_dtype"] == "bfloat16"
    weights = load_file(qwen / "model.safetensors")
    llm = read_state_dict(tiny_model_dir / "llm.pt")
    assert "lm_head.weight" not in weights
    assert "model.norm.weight" in weights and "model.layers.1.mlp.down_proj.weight" in weights
    assert len(weights) == sum(k.startswith("llm.model.model.") for k in llm)
    for key, tensor in weights.items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, llm["llm.model." + key].to(torch.bfloat16)), key
    tokenizer_config = json.loads((qwen / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert tokenizer_config["tokenizer_class"] == "Qwen2Tokenizer"
    assert len(json.loads((qwen / "vocab.json").read_text(encoding="utf-8"))) == 151643


def test_checkpoints_are_fp32(tiny_model_dir: Path) -> None:
    for name in ("llm.pt", "flow.pt", "hift.pt"):
        state = read_state_dict(tiny_model_dir / name)
        assert {t.dtype for t in state.values()} == {torch.float32}, name


def test_our_modules_load_the_checkpoints(tiny_model_dir: Path) -> None:
    load_checkpoint(CosyVoice2LM(TINY.lm), tiny_model_dir / "llm.pt", lm_checkpoint_table(TINY.lm))
    load_checkpoint(Flow(TINY.flow), tiny_model_dir / "flow.pt", flow_checkpoint_table(TINY.flow))
    load_checkpoint(HiFTGenerator(TINY.hift), tiny_model_dir / "hift.pt", hift_checkpoint_table(TINY.hift))


@pytest.mark.parity
def test_upstream_loads_the_directory_strictly(tiny_model_dir: Path) -> None:
    configs = load_yaml_sections(
        (tiny_model_dir / "cosyvoice2.yaml").read_text(encoding="utf-8"),
        ("llm", "flow", "hift"),
        qwen_path=tiny_model_dir / QWEN_DIR,
    )
    configs["llm"].load_state_dict(torch.load(tiny_model_dir / "llm.pt", weights_only=True), strict=True)
    configs["flow"].load_state_dict(torch.load(tiny_model_dir / "flow.pt", weights_only=True), strict=True)
    hift = torch.load(tiny_model_dir / "hift.pt", weights_only=True)
    configs["hift"].load_state_dict({k.replace("generator.", ""): v for k, v in hift.items()}, strict=True)
    # Qwen2Encoder's from_pretrained read our config.json and model.safetensors.
    backbone = configs["llm"].llm.model
    assert backbone.config.num_hidden_layers == TINY.lm.qwen.num_hidden_layers
    assert backbone.lm_head.weight.data_ptr() == backbone.model.embed_tokens.weight.data_ptr()


def _session(path: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def test_campplus_signature_and_output(tiny_model_dir: Path) -> None:
    session = _session(tiny_model_dir / "campplus.onnx")
    fbank = np.random.default_rng(0).standard_normal((2, 173, 80)).astype(np.float32)
    (embedding,) = session.run(None, {session.get_inputs()[0].name: fbank})
    assert embedding.shape == (2, 192)
    assert embedding.dtype == np.float32
    assert np.isfinite(embedding).all() and embedding.std() > 0.01
    (single,) = session.run(None, {session.get_inputs()[0].name: fbank[:1, :50]})
    assert single.shape == (1, 192)


def test_speech_tokenizer_signature_and_output(tiny_model_dir: Path) -> None:
    session = _session(tiny_model_dir / "speech_tokenizer_v2.onnx")
    inputs = session.get_inputs()
    assert [i.type for i in inputs] == ["tensor(float)", "tensor(int32)"]
    # A 3 s prompt at 16 kHz: 300 whisper frames -> 75 tokens at 25 Hz.
    mel = np.random.default_rng(0).uniform(-1.5, 1.5, (2, 128, 300)).astype(np.float32)
    lengths = np.array([300, 201], dtype=np.int32)
    (tokens,) = session.run(None, {inputs[0].name: mel, inputs[1].name: lengths})
    assert tokens.shape == (2, 75)
    assert tokens.dtype == np.int32
    assert tokens.min() >= 0 and tokens.max() < onnx_models.SPEECH_TOKEN_CODES
    assert len(np.unique(tokens[0])) > 30  # random weights still give varied codes
    assert (tokens[1, 50:] == 0).all() and (tokens[1, :50] != 0).any()


def test_onnx_models_are_byte_identical_for_a_seed() -> None:
    for build in (onnx_models.campplus_model, onnx_models.speech_tokenizer_model):
        assert build(7).SerializeToString() == build(7).SerializeToString()
        assert build(7).SerializeToString() != build(8).SerializeToString()


def _params(module: torch.nn.Module) -> int:
    # Parameters shared by several names (tied embeddings) count once.
    return sum(p.numel() for p in module.parameters())


@pytest.mark.slow
def test_full_size_directory(tmp_path: Path) -> None:
    start = time.perf_counter()
    init_model_dir(tmp_path / "full", "full", seed=0)
    elapsed = time.perf_counter() - start
    assert elapsed < 120, f"full init took {elapsed:.0f} s"
    root = tmp_path / "full"
    assert ModelDir.open(root).hparams() == FULL
    lm, flow, hift = CosyVoice2LM(FULL.lm), Flow(FULL.flow), HiFTGenerator(FULL.hift)
    load_checkpoint(lm, root / "llm.pt", lm_checkpoint_table(FULL.lm))
    load_checkpoint(flow, root / "flow.pt", flow_checkpoint_table(FULL.flow))
    load_checkpoint(hift, root / "hift.pt", hift_checkpoint_table(FULL.hift))
    assert _params(lm) == pytest.approx(505.8e6, rel=2e-3)
    assert _params(flow) == pytest.approx(112.5e6, rel=2e-3)
    assert _params(hift) == pytest.approx(20.8e6, rel=5e-3)
    llm = read_state_dict(root / "llm.pt")
    assert llm["llm.model.model.embed_tokens.weight"].shape == (151936, 896)
    assert llm["speech_embedding.weight"].shape == (6564, 896)
    assert llm["llm_decoder.weight"].shape == (6564, 896)
    assert (root / "llm.pt").stat().st_size == pytest.approx(2.02e9, rel=0.02)


def test_cosyvoice3_directory_has_the_official_layout(tiny3_model_dir: Path, tmp_path: Path) -> None:
    """Fun-CosyVoice3-0.5B-2512's files; the same seed gives the same bytes; the RL-tuned
    LM has the LM's keys and shapes with weights of its own (the key lists are checked
    against upstream's modules in tests/models/cosyvoice3)."""
    names = set(_files(tiny3_model_dir))
    assert {
        "cosyvoice3.yaml",
        "llm.pt",
        "llm.rl.pt",
        "flow.pt",
        "hift.pt",
        "campplus.onnx",
        "speech_tokenizer_v3.onnx",
        "spk2info.pt",
        MANIFEST_FILE,
        f"{QWEN_DIR}/config.json",
    } <= names
    assert not {"cosyvoice2.yaml", "speech_tokenizer_v2.onnx"} & names
    model_dir = ModelDir.open(tiny3_model_dir)
    assert model_dir.family is Family.COSYVOICE3
    assert model_dir.llm_rl == tiny3_model_dir / "llm.rl.pt"
    assert model_dir.hparams() == TINY3
    base, rl = read_state_dict(model_dir.llm), read_state_dict(tiny3_model_dir / "llm.rl.pt")
    assert {k: v.shape for k, v in base.items()} == {k: v.shape for k, v in rl.items()}
    assert not torch.equal(base["speech_embedding.weight"], rl["speech_embedding.weight"])
    init_model_dir(tmp_path / "again", "tiny", seed=0, family="cosyvoice3", rl_lm=True)
    assert _files(tmp_path / "again") == _files(tiny3_model_dir)


def test_only_cosyvoice3_has_an_rl_lm(tmp_path: Path) -> None:
    with pytest.raises(ModelDirError, match=r"only CosyVoice 3 directories have an RL-tuned LM"):
        init_model_dir(tmp_path / "x", "tiny", seed=0, rl_lm=True)
    with pytest.raises(ValueError, match="cosyvoice4"):
        init_model_dir(tmp_path / "y", "tiny", seed=0, family="cosyvoice4")
