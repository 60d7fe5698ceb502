"""The pronunciation dictionary in the frontend, on Chinese polyphones (行, 重, 长, 还): a
CosyVoice 3 model reads the dictionary's pinyin tokens instead of the characters, a
CosyVoice 2 model the replacement text."""

from pathlib import Path

import pytest

from cosyserve.engine.loader import LoadedModel, load_model
from cosyserve.frontend.pronunciation import Pronunciations
from cosyserve.pipeline.frontend import Frontend
from cosyserve.pipeline.request import Mode, SynthesisRequest
from cosyserve.pipeline.voice import VoicePrompt

TEXT = "我去银行还钱。他在重庆长大。"
DICTIONARY = "银行 yin2 hang2\n还钱 huan2 qian2\n重庆 chong2 qing4\n长大 zhang3 da4\n"


@pytest.fixture(scope="module")
def model3(tiny3_model_dir: Path) -> LoadedModel:
    return load_model(tiny3_model_dir)


def _text_ids(frontend: Frontend, text: str = TEXT) -> list[int]:
    model = frontend.model
    voice = VoicePrompt.from_embedding(next(iter(model.speakers.values())), "builtin")
    spec = frontend.build_spec(SynthesisRequest(text, Mode.SFT, voice=voice), "r")
    return [i for segment in spec.segments for i in segment.text_ids]


def _contains(ids: list[int], part: list[int]) -> bool:
    return any(ids[i : i + len(part)] == part for i in range(len(ids) - len(part) + 1))


def test_cosyvoice3_speaks_the_dictionarys_pinyin(model3: LoadedModel) -> None:
    frontend = Frontend(model3)
    plain = _text_ids(frontend)
    frontend.pronunciations = Pronunciations.parse(DICTIONARY, cosyvoice3=True)
    ids = _text_ids(frontend)
    encode = model3.tokenizer.encode
    for tokens in ("[h][áng]", "[h][uán]", "[ch][óng]", "[zh][ǎng]"):
        token_ids = encode(tokens)
        assert len(token_ids) == 2  # each bracketed unit is one special token
        assert _contains(ids, token_ids), tokens
        assert not _contains(plain, token_ids)
    for word in ("银行", "还钱", "重庆", "长大"):
        assert not _contains(ids, encode(word))
    assert _contains(ids, encode("我去"))  # the rest of the text is read as before


def test_cosyvoice2_reads_replacement_text(tiny_model_dir: Path) -> None:
    frontend = Frontend(load_model(tiny_model_dir))
    frontend.pronunciations = Pronunciations.parse("重庆 崇庆\n", cosyvoice3=False)
    assert _text_ids(frontend, "重庆。") == _text_ids(Frontend(frontend.model), "崇庆。")
