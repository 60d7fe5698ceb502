import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from cosyserve.errors import ModelDirError
from cosyserve.frontend.text_tokenizer import COSYVOICE2_SPECIAL_TOKENS, TextTokenizer
from cosyserve.modeldir.layout import QWEN_DIR
from tests.upstream import upstream

TEXTS = [
    "八百标兵奔北坡，北坡炮兵并排跑，炮兵怕把标兵碰，标兵怕碰炮兵炮。",
    "希望你以后能够做的比我还好呦。",
    "The quick brown fox jumps over the lazy dog.",
    "I'M sure they'll say it's DON'T, we've, you'd.",
    "我最近在学习 Python 和 machine learning，latency 大约 200 ms。",
    "Emoji 😀🎉👍🏽 and flags 🇨🇳 mixed with 中文。",
    "  leading spaces,\ttabs\n\nand\r\nnewlines   ",
    "Numbers 1234567 and 3.14159, dates 2025-01-31.",
    "e\u0301 NFC-combining, ｆｕｌｌｗｉｄｔｈ, ①②③, Ελληνικά, русский, 日本語のテキスト, 한국어",
    "<|endofprompt|>",
    "You are a helpful assistant.<|endofprompt|>用开心的语气说这句话。",
    "[laughter]哈哈[laughter]，然后<strong>重点</strong>[breath]继续[noise][mn]",
    "<|im_start|>user\nhi<|im_end|><|endoftext|>",
    "<|en|>Language tags are plain text in CosyVoice 2.",
    "[vocalized-noise][lipsmack][quick_breath][sigh][hissing][cough][clucking][accent]",
    "<laughter>笑着说</laughter>",
    "",
]


def _upstream_tokenizer(path: Path) -> Any:
    # Upstream's tokenizer module also imports whisper and tiktoken for its v1 tokenizer;
    # the Qwen tokenizer under test uses neither, so empty stand-ins suffice.
    for name in ("whisper", "whisper.tokenizer", "tiktoken"):
        sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules["whisper.tokenizer"].Tokenizer = object  # type: ignore[attr-defined]
    module = upstream("cosyvoice.tokenizer.tokenizer")
    return module.get_qwen_tokenizer(str(path), skip_special_tokens=True)


@pytest.fixture(scope="module")
def qwen_dir(tiny_model_dir: Path) -> Path:
    return tiny_model_dir / QWEN_DIR


@pytest.fixture(scope="module")
def ours(qwen_dir: Path) -> TextTokenizer:
    return TextTokenizer.from_dir(qwen_dir)


@pytest.mark.parity
def test_ids_and_decoding_match_upstream(qwen_dir: Path, ours: TextTokenizer) -> None:
    theirs = _upstream_tokenizer(qwen_dir)
    assert ours.vocab_size == len(theirs.tokenizer) == 151663
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        assert ours.decode(ids) == theirs.decode(ids), text


def test_special_tokens_have_official_ids(ours: TextTokenizer) -> None:
    ids = [ours.token_id(t) for t in COSYVOICE2_SPECIAL_TOKENS]
    assert ids == list(range(151643, 151663))
    assert ours.encode("<|endofprompt|>[breath][mn]") == [151646, 151647, 151662]


def test_round_trip_and_special_tokens_skipped_on_decode(ours: TextTokenizer) -> None:
    text = "你好，world! 😀"
    assert ours.decode(ours.encode(text)) == text
    assert ours.decode(ours.encode("a<|endofprompt|>b")) == "ab"
    assert ours.decode(ours.encode("a<|endofprompt|>b"), skip_special_tokens=False) == "a<|endofprompt|>b"


def test_unknown_token_lookup_raises_key_error(ours: TextTokenizer) -> None:
    with pytest.raises(KeyError):
        ours.token_id("<|no such token|>")


def _copy_tokenizer(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for name in ("vocab.json", "merges.txt", "tokenizer_config.json"):
        (dst / name).write_bytes((src / name).read_bytes())
    return dst


@pytest.mark.parametrize(
    ("file", "content", "message"),
    [
        ("vocab.json", None, "vocab.json: tokenizer file not found"),
        ("merges.txt", None, "merges.txt: tokenizer file not found"),
        ("vocab.json", "{not json", "vocab.json: not readable JSON"),
        ("vocab.json", '["a", "b"]', "not a JSON object of token -> id"),
        ("merges.txt", "#version: 0.2\na b c\n", "merges.txt:2: a merge must be two tokens"),
        ("merges.txt", "#version: 0.2\nzz qq\n", "do not load"),
        ("tokenizer_config.json", '{"added_tokens_decoder": []}', "is not an object"),
        ("tokenizer_config.json", '{"added_tokens_decoder": {"x": {}}}', "malformed 'added_tokens_decoder'"),
        (
            "tokenizer_config.json",
            '{"added_tokens_decoder": {"7": {"content": "<|endoftext|>", "special": true}}}',
            "declared as id 7 but lands on 151643",
        ),
    ],
)
def test_broken_tokenizer_dir_is_a_model_dir_error(
    qwen_dir: Path, tmp_path: Path, file: str, content: str | None, message: str
) -> None:
    broken = _copy_tokenizer(qwen_dir, tmp_path / "tok")
    if content is None:
        (broken / file).unlink()
    else:
        (broken / file).write_text(content, encoding="utf-8")
    with pytest.raises(ModelDirError, match=message):
        TextTokenizer.from_dir(broken)


def test_vocabulary_of_the_wrong_size_is_rejected(qwen_dir: Path, tmp_path: Path) -> None:
    broken = _copy_tokenizer(qwen_dir, tmp_path / "tok")
    vocab = json.loads((broken / "vocab.json").read_text(encoding="utf-8"))
    del vocab["<|unused_151642|>"]
    (broken / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    config = json.loads((broken / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["added_tokens_decoder"] = {}
    (broken / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    with pytest.raises(ModelDirError, match="would get id 151645, not 151646"):
        TextTokenizer.from_dir(broken)
