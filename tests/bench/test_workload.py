"""``cosyserve.bench.workload``: the zero-shot prompt each family's LM gets in benchmarks."""

from pathlib import Path

from cosyserve.bench.workload import family_prompt, synthetic_voice
from cosyserve.frontend.text_tokenizer import ENDOFPROMPT_ID
from cosyserve.modeldir.layout import ModelDir
from cosyserve.pipeline.llm_prompt import system_prompt


def test_cosyvoice2_prompt_is_the_transcript(tiny_model_dir: Path) -> None:
    directory = ModelDir.open(tiny_model_dir)
    voice = synthetic_voice(directory.hparams(), 1.0, seed=3)
    assert family_prompt(directory, voice) is voice


def test_cosyvoice3_prompt_opens_with_the_system_prompt(tiny3_model_dir: Path) -> None:
    directory = ModelDir.open(tiny3_model_dir)
    voice = synthetic_voice(directory.hparams(), 1.0, seed=3)
    head = tuple(directory.text_tokenizer().encode(system_prompt()))
    prompted = family_prompt(directory, voice)
    assert ENDOFPROMPT_ID in head
    assert prompted.prompt_text_ids == head + voice.prompt_text_ids
    assert prompted.speech_tokens is voice.speech_tokens and prompted.mel is voice.mel
