"""A fixed synthetic workload: prompt, text and forced lengths, the same on every run.

Random weights never learn when to stop, so every request forces its speech-token count;
the prompt is random too (tokens, mel and embedding from a seeded generator), which costs
the model exactly what a real prompt of the same length costs.
"""

import dataclasses

import torch

from cosyserve.engine.request import GenerationSpec, Segment
from cosyserve.frontend.text_tokenizer import ENDOFPROMPT_ID
from cosyserve.modeldir.family import Family
from cosyserve.modeldir.hparams import ModelHParams
from cosyserve.modeldir.hparams3 import Model3HParams
from cosyserve.modeldir.layout import ModelDir
from cosyserve.pipeline.llm_prompt import system_prompt
from cosyserve.pipeline.voice import VoicePrompt

# Qwen2's regular ids end here; the special tokens above it are never random text.
_REGULAR_TEXT_IDS = 151_643
# About what the Qwen2 tokenizer gives per second of Chinese speech (4 characters/s).
TEXT_TOKENS_PER_SECOND = 4


def synthetic_voice(
    hparams: ModelHParams | Model3HParams, prompt_seconds: float, seed: int = 0, name: str = ""
) -> VoicePrompt:
    """A zero-shot voice of ``prompt_seconds`` of prompt: 25 speech tokens and 50 mel frames
    per second, a transcript of :data:`TEXT_TOKENS_PER_SECOND` ids per second."""
    gen = torch.Generator().manual_seed(seed)
    flow = hparams.flow
    n_tokens = round(prompt_seconds * flow.input_frame_rate)
    n_text = max(1, round(prompt_seconds * TEXT_TOKENS_PER_SECOND))
    return VoicePrompt(
        prompt_text_ids=tuple(torch.randint(0, _REGULAR_TEXT_IDS, (n_text,), generator=gen).tolist()),
        speech_tokens=torch.randint(0, flow.vocab_size, (n_tokens,), generator=gen),
        mel=torch.randn(n_tokens * flow.token_mel_ratio, flow.output_size, generator=gen),
        embedding=torch.randn(flow.spk_embed_dim, generator=gen),
        name=name or f"synthetic-{seed}",
    )


def family_prompt(directory: ModelDir, voice: VoicePrompt) -> VoicePrompt:
    """``voice`` with the LM prompt our frontend gives a zero-shot request of the directory's
    family: CosyVoice 3's opens with its system prompt, which ends in ``<|endofprompt|>``
    (upstream's CosyVoice 3 LM asserts the marker is there); CosyVoice 2's is the transcript."""
    if directory.family is not Family.COSYVOICE3:
        return voice
    head = tuple(directory.text_tokenizer().encode(system_prompt()))
    if ENDOFPROMPT_ID not in head:
        raise ValueError("the system prompt does not end its prompt with <|endofprompt|>")
    return dataclasses.replace(voice, prompt_text_ids=head + voice.prompt_text_ids)


def synthetic_text_ids(
    hparams: ModelHParams | Model3HParams, speech_tokens: int, seed: int = 0
) -> tuple[int, ...]:
    """Text ids about as long as ``speech_tokens`` speech tokens of speech would need."""
    seconds = speech_tokens / hparams.flow.input_frame_rate
    n = max(1, round(seconds * TEXT_TOKENS_PER_SECOND))
    gen = torch.Generator().manual_seed(10_000 + seed)
    return tuple(torch.randint(0, _REGULAR_TEXT_IDS, (n,), generator=gen).tolist())


def synthetic_spec(
    request_id: str,
    voice: VoicePrompt,
    text_ids: tuple[int, ...],
    *,
    tokens: int,
    seed: int = 0,
    stream: bool = False,
    first_hop: int | None = None,
) -> GenerationSpec:
    """A zero-shot request that generates exactly ``tokens`` speech tokens."""
    return GenerationSpec(
        request_id=request_id,
        segments=(Segment(text_ids=text_ids),),
        embedding=voice.embedding,
        flow_prompt_tokens=voice.speech_tokens,
        flow_prompt_mel=voice.mel,
        lm_prefix_ids=voice.prompt_text_ids,
        lm_prompt_speech=tuple(int(t) for t in voice.speech_tokens.tolist()),
        seed=seed,
        stream=stream,
        first_hop=first_hop,
        min_tokens=tokens,
        max_tokens=tokens,
    )
