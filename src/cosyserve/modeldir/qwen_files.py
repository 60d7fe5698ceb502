"""Write ``CosyVoice-BlankEN/``: the Qwen2 config, weights and tokenizer files.

Upstream loads this directory twice: ``Qwen2ForCausalLM.from_pretrained`` (config and
``model.safetensors``; the weights are then overwritten by ``llm.pt``) and
``AutoTokenizer.from_pretrained`` (the tokenizer files). The official tokenizer cannot be
downloaded here, so we train a small byte-level BPE on a built-in corpus and pad its
vocabulary so that every special token sits at its official Qwen2 id.
"""

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, pre_tokenizers, trainers
from tokenizers.models import BPE

from cosyserve.frontend.text_tokenizer import (
    MERGES_FILE,
    TOKENIZER_CONFIG_FILE,
    VOCAB_FILE,
    configure_qwen2_pipeline,
)
from cosyserve.modeldir.hparams import Qwen2Config

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
WEIGHTS_FILE = "model.safetensors"

# Qwen2's regular (BPE) ids are 0..151642; its three added tokens follow.
QWEN2_REGULAR_IDS = 151643
QWEN2_ADDED_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
ENDOFTEXT_ID = QWEN2_REGULAR_IDS

# Enough merges to make the corpus' words and most common ideographs single tokens, while
# training stays well under a second.
_BPE_VOCAB_SIZE = 12_000
# The key prefix of the Qwen2 backbone inside llm.pt (Qwen2LM.llm.model is a Qwen2ForCausalLM).
LLM_BACKBONE_PREFIX = "llm.model."

# Deliberately excludes the sentences used in benchmarks and parity tests, so that those
# encode to realistic token counts instead of a handful of memorised merges.
_CORPUS = (
    "今天天气很好，我们一起去公园散步吧。",
    "请把这份文件发给我，谢谢你的帮助。",
    "他说明天早上八点在火车站见面。",
    "这家餐厅的菜做得非常好吃，价格也不贵。",
    "人工智能正在改变我们的生活和工作方式。",
    "语音合成技术可以把文字转换成自然流畅的声音。",
    "小明每天晚上都会读一个小时的书。",
    "春天来了，花园里的花都开了。",
    "我们公司的会议改到下午三点了。",
    "你能告诉我去图书馆怎么走吗？",
    "学习一门新的语言需要耐心和坚持。",
    "这个问题很复杂，我们需要再讨论一下。",
    "她唱歌的声音非常好听，大家都很喜欢。",
    "北京、上海和广州都是中国的大城市。",
    "欢迎大家来参加今天的活动！",
    "The quick brown fox jumps over the lazy dog.",
    "Speech synthesis turns written text into natural sounding audio.",
    "Please send me the report before the meeting on Monday.",
    "It's a beautiful day, and we're going for a walk in the park.",
    "They've been working on this project for three years.",
    "I'll call you back when I'm done with the interview.",
    "The model generates speech tokens at twenty five hertz.",
    "Streaming inference returns the first audio chunk quickly.",
    "Hello world! How are you doing today?",
    "Numbers like 42, 3.14 and 2025 are read digit by digit.",
    "We'd like to thank everyone who contributed to the release.",
    'She said: "This is the best coffee I have ever had."',
    "Machine learning, deep learning, and neural networks.",
    "我最近在学习 Python 和 machine learning。",
    "这个 API 的 latency 大约是 200 毫秒。",
    "Let's meet at 北京 station tomorrow morning.",
    "CosyVoice 是一个支持多语言的语音合成模型。",
)


def write_tokenizer_files(directory: Path) -> None:
    """Write ``vocab.json``, ``merges.txt`` and ``tokenizer_config.json`` (deterministic)."""
    vocab, merges = _train_bpe()
    if len(vocab) > QWEN2_REGULAR_IDS:
        raise RuntimeError(f"trained vocabulary too large: {len(vocab)}")
    # Filler entries are not produced by any merge, so no text ever encodes to them; they
    # only move the added tokens to Qwen2's ids.
    for token_id in range(len(vocab), QWEN2_REGULAR_IDS):
        vocab[f"<|unused_{token_id}|>"] = token_id
    _write_json(directory / VOCAB_FILE, vocab, indent=None)
    (directory / MERGES_FILE).write_text(
        "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8"
    )
    _write_json(directory / TOKENIZER_CONFIG_FILE, _tokenizer_config())


def write_qwen_config(directory: Path, qwen: Qwen2Config) -> None:
    """Write ``config.json`` and ``generation_config.json`` with Qwen2.5-0.5B's fields."""
    config = {
        "architectures": ["Qwen2ForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": ENDOFTEXT_ID,
        "eos_token_id": ENDOFTEXT_ID,
        "hidden_act": "silu",
        "hidden_size": qwen.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": qwen.intermediate_size,
        "max_position_embeddings": qwen.max_position_embeddings,
        "max_window_layers": qwen.num_hidden_layers,
        "model_type": "qwen2",
        "num_attention_heads": qwen.num_attention_heads,
        "num_hidden_layers": qwen.num_hidden_layers,
        "num_key_value_heads": qwen.num_key_value_heads,
        "rms_norm_eps": qwen.rms_norm_eps,
        "rope_theta": qwen.rope_theta,
        "sliding_window": qwen.max_position_embeddings,
        "tie_word_embeddings": qwen.tie_word_embeddings,
        "torch_dtype": "bfloat16",
        # The value in the released file; transformers only reads it for warnings.
        "transformers_version": "4.40.1",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": qwen.vocab_size,
    }
    _write_json(directory / CONFIG_FILE, config)
    generation = {
        "bos_token_id": ENDOFTEXT_ID,
        "do_sample": False,
        "eos_token_id": ENDOFTEXT_ID,
        "max_new_tokens": 2048,
        "transformers_version": "4.37.0",
    }
    _write_json(directory / GENERATION_CONFIG_FILE, generation)


def write_qwen_weights(directory: Path, llm_checkpoint: Mapping[str, torch.Tensor]) -> None:
    """Write ``model.safetensors``: llm.pt's Qwen2 backbone under HF names, in bf16.

    The tied ``lm_head.weight`` is left out, as transformers does when saving.
    """
    tensors = {
        key.removeprefix(LLM_BACKBONE_PREFIX): tensor.to(torch.bfloat16).contiguous()
        for key, tensor in llm_checkpoint.items()
        if key.startswith(LLM_BACKBONE_PREFIX + "model.")
    }
    if not tensors:
        raise RuntimeError("llm checkpoint has no Qwen2 backbone tensors")
    save_file(tensors, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})


def _corpus() -> Iterator[str]:
    yield from _CORPUS
    # Every CJK unified ideograph once, so that frequent byte pairs of Chinese text merge.
    yield "\n".join(chr(c) for c in range(0x4E00, 0x9FA6))


def _train_bpe() -> tuple[dict[str, int], list[tuple[str, str]]]:
    tokenizer = Tokenizer(BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    configure_qwen2_pipeline(tokenizer)
    trainer = trainers.BpeTrainer(
        vocab_size=_BPE_VOCAB_SIZE,
        min_frequency=1,
        show_progress=False,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    model = json.loads(tokenizer.to_str())["model"]
    vocab: dict[str, int] = dict(sorted(model["vocab"].items(), key=lambda item: item[1]))
    return vocab, [(a, b) for a, b in model["merges"]]


def _tokenizer_config() -> dict[str, Any]:
    added = {
        str(ENDOFTEXT_ID + i): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, token in enumerate(QWEN2_ADDED_TOKENS)
    }
    return {
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": list(QWEN2_ADDED_TOKENS[1:]),
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": QWEN2_ADDED_TOKENS[0],
        "errors": "replace",
        "model_max_length": 32768,
        "pad_token": QWEN2_ADDED_TOKENS[0],
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def _write_json(path: Path, data: Mapping[str, Any], indent: int | None = 2) -> None:
    path.write_text(json.dumps(data, ensure_ascii=False, indent=indent) + "\n", encoding="utf-8")
