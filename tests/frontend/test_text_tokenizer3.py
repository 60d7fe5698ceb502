"""The CosyVoice 3 text tokenizer against upstream's ``CosyVoice3Tokenizer`` (commit ace7c47),
through the committed fixture of ``tests/models/cosyvoice3/make_tokenizer_fixtures.py``."""

import json
from pathlib import Path
from typing import Any

import pytest

from cosyserve.errors import ModelDirError
from cosyserve.frontend.text_tokenizer import (
    COSYVOICE2_SPECIAL_TOKENS,
    COSYVOICE3_SPECIAL_TOKENS,
    TextTokenizer,
)
from cosyserve.modeldir.qwen_files import write_tokenizer_files

FIXTURE = Path(__file__).parents[1] / "models" / "cosyvoice3" / "fixtures" / "tokenizer.json"


@pytest.fixture(scope="module")
def fixture() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(FIXTURE.read_text(encoding="utf-8"))
    return data


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The CosyVoice-BlankEN tokenizer files as ``cosyserve model init`` writes them."""
    path = tmp_path_factory.mktemp("blank_en")
    write_tokenizer_files(path)
    return path


@pytest.fixture(scope="module")
def ours(qwen_dir: Path) -> TextTokenizer:
    return TextTokenizer.from_dir(qwen_dir, COSYVOICE3_SPECIAL_TOKENS)


@pytest.mark.parity
def test_ids_and_decoding_match_upstream(fixture: dict[str, Any], ours: TextTokenizer) -> None:
    assert ours.vocab_size == fixture["vocab_size"] == 151924
    for case in fixture["cases"]:
        ids = ours.encode(case["text"])
        assert ids == case["ids"], case["text"]
        assert ours.decode(ids) == case["decoded"], case["text"]


@pytest.mark.parity
def test_every_added_token_has_upstreams_id(fixture: dict[str, Any], ours: TextTokenizer) -> None:
    added = fixture["added_token_ids"]
    # Upstream's list is ours without <|endoftext|>, which it sets as eos instead.
    assert list(added) == list(COSYVOICE3_SPECIAL_TOKENS[1:])
    assert {t: ours.token_id(t) for t in added} == added
    assert ours.token_id("<|endoftext|>") == 151643


def test_cosyvoice3_tokens_extend_cosyvoice2s(ours: TextTokenizer) -> None:
    assert COSYVOICE3_SPECIAL_TOKENS[: len(COSYVOICE2_SPECIAL_TOKENS)] == COSYVOICE2_SPECIAL_TOKENS
    assert len(COSYVOICE3_SPECIAL_TOKENS) == len(set(COSYVOICE3_SPECIAL_TOKENS)) == 281
    assert ours.encode("<|endofprompt|>[breath]<|endofsystem|>") == [151646, 151647, 151663]
    assert ours.encode("[h][ǎo]") == [ours.token_id("[h]"), ours.token_id("[ǎo]")]


def test_cosyvoice2_tokenizer_does_not_know_the_new_tokens(qwen_dir: Path) -> None:
    cv2 = TextTokenizer.from_dir(qwen_dir)
    assert cv2.vocab_size == 151663
    with pytest.raises(KeyError):
        cv2.token_id("[HH]")
    assert len(cv2.encode("[HH]")) > 1


def test_a_vocabulary_holding_some_new_tokens_is_rejected(qwen_dir: Path, tmp_path: Path) -> None:
    broken = tmp_path / "tok"
    broken.mkdir()
    for name in ("vocab.json", "merges.txt", "tokenizer_config.json"):
        (broken / name).write_bytes((qwen_dir / name).read_bytes())
    vocab = json.loads((broken / "vocab.json").read_text(encoding="utf-8"))
    vocab["[HH]"] = vocab.pop("<|unused_151642|>")  # the id count stays, one token is known
    (broken / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    with pytest.raises(ModelDirError, match=r"\[ǜ\] would get id 151922, not 151923"):
        TextTokenizer.from_dir(broken, COSYVOICE3_SPECIAL_TOKENS)
