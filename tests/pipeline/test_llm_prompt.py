"""What the LM reads before the text: CosyVoice 3's system prompt where the caller gave no
``<|endofprompt|>``, the caller's own prompt where they did, CosyVoice 2 unchanged."""

from pathlib import Path

import pytest
import torch

from cosyserve.engine.loader import LoadedModel, load_model
from cosyserve.pipeline.frontend import Frontend
from cosyserve.pipeline.llm_prompt import END_OF_PROMPT, instruction, split_text_prompt, system_prompt
from cosyserve.pipeline.request import Mode, SynthesisRequest
from cosyserve.pipeline.voice import VoicePrompt


@pytest.fixture(scope="module")
def frontend3(tiny3_model_dir: Path) -> Frontend:
    return Frontend(load_model(tiny3_model_dir))


def _voice(model: LoadedModel, prompt_text: str) -> VoicePrompt:
    ids = tuple(model.tokenizer.encode(prompt_text)) if prompt_text else ()
    return VoicePrompt(
        prompt_text_ids=ids,
        speech_tokens=torch.arange(10),
        mel=torch.zeros(20, 80),
        embedding=torch.ones(192),
        name="v",
        prompt_text=prompt_text,
    )


def test_split_and_instruction_rules() -> None:
    assert split_text_prompt("hi").head == ""
    prompt = split_text_prompt(f"Speak softly.{END_OF_PROMPT}你好{END_OF_PROMPT}")
    assert (prompt.head, prompt.body) == (f"Speak softly.{END_OF_PROMPT}", f"你好{END_OF_PROMPT}")
    assert instruction("用四川话说", cosyvoice3=False) == f"用四川话说{END_OF_PROMPT}"
    expected = f"You are a helpful assistant. 用四川话说{END_OF_PROMPT}"
    assert instruction("用四川话说", cosyvoice3=True) == expected
    own = f"You are a radio host.{END_OF_PROMPT}"
    assert instruction(own, cosyvoice3=True) == own


@pytest.mark.parametrize("mode", [Mode.ZERO_SHOT, Mode.CROSS_LINGUAL, Mode.SFT])
def test_cosyvoice3_adds_its_system_prompt(frontend3: Frontend, mode: Mode) -> None:
    model = frontend3.model
    voice = _voice(model, "希望你以后能够做的比我还好呦。")
    spec = frontend3.build_spec(SynthesisRequest("你好。", mode, voice=voice), "r")
    system = tuple(model.tokenizer.encode(system_prompt()))
    expected = system + (voice.prompt_text_ids if mode is Mode.ZERO_SHOT else ())
    assert spec.lm_prefix_ids == expected
    assert spec.segments[0].text_ids == tuple(model.tokenizer.encode("你好。"))


def test_a_marked_prompt_transcript_is_used_as_it_is(frontend3: Frontend) -> None:
    transcript = f"You are a helpful assistant.{END_OF_PROMPT}希望你以后能够做的比我还好呦。"
    voice = _voice(frontend3.model, transcript)
    spec = frontend3.build_spec(SynthesisRequest("你好。", Mode.ZERO_SHOT, voice=voice), "r")
    assert spec.lm_prefix_ids == voice.prompt_text_ids


def test_the_callers_own_prompt_heads_every_sentence(frontend3: Frontend) -> None:
    model = frontend3.model
    head = f"You are a helpful assistant.{END_OF_PROMPT}"
    text = head + "这一句话说得比较长，为了让分句器把它分开。" * 12
    spec = frontend3.build_spec(SynthesisRequest(text, Mode.CROSS_LINGUAL, voice=_voice(model, "")), "r")
    head_ids = tuple(model.tokenizer.encode(head))
    assert len(spec.segments) >= 2
    assert all(s.text_ids[: len(head_ids)] == head_ids for s in spec.segments)
    assert spec.lm_prefix_ids == ()


def test_cosyvoice3_instruct2(frontend3: Frontend) -> None:
    model = frontend3.model
    voice = _voice(model, "x")
    request = SynthesisRequest("你好。", Mode.INSTRUCT2, voice=voice, instruct="请用广东话表达。")
    spec = frontend3.build_spec(request, "r")
    expected = f"You are a helpful assistant. 请用广东话表达。{END_OF_PROMPT}"
    assert spec.lm_prefix_ids == tuple(model.tokenizer.encode(expected))
