"""The native LM on its own: KV cache bookkeeping, incremental decoding against the full
forward, prompt layout and checkpoint round trips and errors."""

import copy
from pathlib import Path

import pytest
import torch

from cosyserve.errors import CheckpointError, InvalidRequestError, ModelDirError
from cosyserve.modeldir.hparams import LMConfig
from cosyserve.modeldir.presets import TINY
from cosyserve.models.kv_cache import CacheFullError, KVCache, SequenceTooLongError
from cosyserve.models.lm import CosyVoice2LM, lm_checkpoint_table
from cosyserve.models.span_attention import KEY_BLOCK
from cosyserve.weights.checkpoint import load_checkpoint, to_checkpoint

CFG = TINY.lm
TOL = 1e-5


def _prompt(model: CosyVoice2LM, seed: int, n_text: int, n_speech: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    text = torch.randint(0, CFG.qwen.vocab_size, (n_text,), generator=gen)
    speech = torch.randint(0, CFG.speech_token_size, (n_speech,), generator=gen)
    return model.prompt_embeddings(text, speech)


def _cache(max_slots: int = 4, max_len: int = 64, dtype: torch.dtype = torch.float32) -> KVCache:
    return KVCache.for_config(CFG.qwen, max_slots, max_len, dtype)


def test_cache_hands_out_and_takes_back_slots() -> None:
    cache = _cache(max_slots=2)
    assert [cache.allocate(), cache.allocate()] == [0, 1]
    with pytest.raises(CacheFullError, match="all 2 slots"):
        cache.allocate()
    cache.free(0)
    assert cache.free_slots == 1
    assert cache.allocate() == 0
    with pytest.raises(ValueError, match="not an allocated slot"):
        cache.free(5)


def test_cache_refuses_to_grow_a_sequence_past_max_len(lm: CosyVoice2LM) -> None:
    cache = _cache(max_len=8)
    slot = cache.allocate()
    with torch.no_grad():
        lm.prefill(_prompt(lm, 0, 4, 2), slot, cache)
        with pytest.raises(SequenceTooLongError, match="reach 11 positions"):
            lm.prefill(_prompt(lm, 0, 1, 0), slot, cache)
    assert cache.length(slot) == 8  # the refused step changed nothing


def test_cache_step_must_be_committed_against_the_state_it_began_from() -> None:
    cache = _cache()
    slot = cache.allocate()
    step = cache.begin([slot], 3)
    cache.commit(cache.begin([slot], 2))
    with pytest.raises(ValueError, match="changed between"):
        cache.commit(step)
    with pytest.raises(ValueError, match="twice"):
        cache.begin([slot, slot], 1)


@torch.no_grad()
def test_chunked_prefill_and_decode_equal_the_full_forward(lm: CosyVoice2LM) -> None:
    prompt = _prompt(lm, 1, 9, 4)  # (15, H)
    tokens = torch.tensor([5, 6000, 17, 17, 2048])
    full = torch.cat([prompt, lm.speech_embedding(tokens)])
    _, logits = lm.teacher_forced(full[None])
    expected = logits[0].float().log_softmax(-1)  # (20, 6564)

    cache = _cache()
    slot = cache.allocate()
    lm.prefill(prompt[:6], slot, cache)
    out = [lm.prefill(prompt[6:], slot, cache)]  # a chunk continuing the prefix
    for token in tokens:
        out.append(lm.decode(token[None], [slot], cache)[0])
    got = torch.stack(out)
    assert cache.length(slot) == 20
    assert (got - expected[14:]).abs().max() <= TOL


@torch.no_grad()
def test_batched_decode_of_sequences_of_different_lengths(lm: CosyVoice2LM) -> None:
    cache = _cache()
    slots = [cache.allocate() for _ in range(4)]
    cache.free(slots[1])  # leave a hole: live slots need not be contiguous
    live = [slots[3], slots[0], slots[2]]
    prompts = [_prompt(lm, 10 + i, n, m) for i, (n, m) in enumerate([(3, 0), (11, 5), (6, 2)])]
    for slot, prompt in zip(live, prompts, strict=True):
        lm.prefill(prompt, slot, cache)
    steps = torch.tensor([[7, 8, 9], [100, 200, 300]])
    for row in steps:
        got = lm.decode(row, live, cache)
    for i, prompt in enumerate(prompts):
        full = torch.cat([prompt, lm.speech_embedding(steps[:, i])])
        expected = lm.teacher_forced(full[None])[1][0, -1].float().log_softmax(-1)
        assert (got[i] - expected).abs().max() <= TOL


def test_a_step_reads_whole_key_blocks_and_hides_what_lies_past_each_row() -> None:
    cache = _cache()
    a, b = cache.allocate(), cache.allocate()
    first = cache.begin([a], 1)
    assert first.span == KEY_BLOCK  # one position, read as a whole block
    assert first.mask[0, 0, 0].tolist() == [True] + [False] * (KEY_BLOCK - 1)
    prefill = cache.begin([a], 3)
    assert prefill.mask.shape == (1, 1, 3, KEY_BLOCK)
    causal = [[True, False, False, False], [True, True, False, False], [True, True, True, False]]
    assert prefill.mask[0, 0, :, :4].tolist() == causal
    cache.commit(prefill)
    ragged = cache.begin([a, b], 1)
    # Built when first read: a step replayed from a captured graph never reads it.
    assert "mask" not in vars(ragged)
    assert ragged.span == KEY_BLOCK
    assert ragged.mask[:, 0, 0, :5].tolist() == [[True] * 4 + [False], [True] + [False] * 4]
    assert ragged.mask is ragged.mask  # and built once


def test_the_cache_holds_max_len_padded_to_whole_key_blocks() -> None:
    cache = _cache(max_len=KEY_BLOCK + 1)
    assert cache.capacity == 2 * KEY_BLOCK and cache.k.shape[3] == 2 * KEY_BLOCK
    slot = cache.allocate()
    cache.commit(cache.begin([slot], KEY_BLOCK + 1))
    with pytest.raises(SequenceTooLongError):
        cache.begin([slot], 1)  # the padding is for reading whole blocks, not for more positions


@torch.no_grad()
def test_batched_decode_of_sequences_of_equal_length(lm: CosyVoice2LM) -> None:
    cache = _cache()
    slots = [cache.allocate() for _ in range(3)]
    prompts = [_prompt(lm, 20 + i, 5, 3) for i in range(3)]
    for slot, prompt in zip(slots, prompts, strict=True):
        lm.prefill(prompt, slot, cache)
    steps = torch.tensor([[1, 2, 3], [40, 50, 60]])
    for row in steps:
        got = lm.decode(row, slots, cache)
    for i, prompt in enumerate(prompts):
        full = torch.cat([prompt, lm.speech_embedding(steps[:, i])])
        expected = lm.teacher_forced(full[None])[1][0, -1].float().log_softmax(-1)
        assert (got[i] - expected).abs().max() <= TOL


@torch.no_grad()
def test_one_model_serves_independent_caches(lm: CosyVoice2LM) -> None:
    a, b = _prompt(lm, 20, 5, 1), _prompt(lm, 21, 8, 3)
    alone = _cache()
    slot = alone.allocate()
    lm.prefill(a, slot, alone)
    expected = lm.decode(torch.tensor([42]), [slot], alone)
    shared, other = _cache(), _cache()
    s1, s2 = shared.allocate(), other.allocate()
    lm.prefill(a, s1, shared)
    lm.prefill(b, s2, other)
    lm.decode(torch.tensor([1]), [s2], other)
    assert torch.equal(lm.decode(torch.tensor([42]), [s1], shared), expected)


@torch.no_grad()
def test_freed_slot_starts_clean(lm: CosyVoice2LM) -> None:
    cache = _cache(max_slots=1)
    slot = cache.allocate()
    lm.prefill(_prompt(lm, 30, 10, 10), slot, cache)
    cache.free(slot)
    assert cache.k.abs().sum() == 0 and cache.v.abs().sum() == 0
    slot = cache.allocate()
    prompt = _prompt(lm, 31, 3, 0)
    got = lm.prefill(prompt, slot, cache)
    expected = lm.teacher_forced(prompt[None])[1][0, -1].float().log_softmax(-1)
    assert (got - expected).abs().max() <= TOL


@torch.no_grad()
def test_float64_model_agrees_with_float32(lm: CosyVoice2LM) -> None:
    """Nothing in the model is tied to float32."""
    wide = CosyVoice2LM(CFG)
    wide.load_state_dict(lm.state_dict())
    wide = wide.double()
    prompt = _prompt(lm, 40, 6, 3)
    cache = _cache(dtype=torch.float64)
    slot = cache.allocate()
    wide.prefill(prompt.double(), slot, cache)
    got = wide.decode(torch.tensor([3]), [slot], cache)[0]
    cache32 = _cache()
    slot = cache32.allocate()
    lm.prefill(prompt, slot, cache32)
    expected = lm.decode(torch.tensor([3]), [slot], cache32)[0]
    assert got.dtype == torch.float32  # log-probs are always float32
    assert (got - expected).abs().max() <= 1e-4


def test_prompt_layout_is_sos_text_task_id_speech(lm: CosyVoice2LM) -> None:
    text, speech = torch.tensor([1, 2, 3]), torch.tensor([9, 8])
    emb = lm.prompt_embeddings(text, speech)
    assert emb.shape == (7, CFG.qwen.hidden_size)
    assert torch.equal(emb[0], lm.llm_embedding.weight[0])
    assert torch.equal(emb[1:4], lm.qwen.embed_tokens.weight[text])
    assert torch.equal(emb[4], lm.llm_embedding.weight[1])
    assert torch.equal(emb[5:], lm.speech_embedding.weight[speech])
    assert lm.prompt_embeddings(text, torch.zeros(0, dtype=torch.long)).shape[0] == 5


@pytest.mark.parametrize(
    ("text", "speech", "message"),
    [
        (torch.tensor([1.0]), torch.tensor([1]), "1-D long"),
        (torch.tensor([-1]), torch.tensor([1]), r"text token ids must lie in \[0, 151936\)"),
        (torch.tensor([1]), torch.tensor([6561]), r"prompt speech token ids must lie in \[0, 6561\)"),
    ],
)
def test_bad_prompt_ids_are_request_errors(
    lm: CosyVoice2LM, text: torch.Tensor, speech: torch.Tensor, message: str
) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        lm.prompt_embeddings(text, speech)


def test_geometry_mismatch_is_a_model_dir_error() -> None:
    with pytest.raises(ModelDirError, match="must equal the Qwen2 hidden_size"):
        CosyVoice2LM(LMConfig(qwen=CFG.qwen, llm_input_size=896, llm_output_size=896))


def test_text_head_is_never_held(lm: CosyVoice2LM) -> None:
    rows = CFG.qwen.vocab_size
    assert [n for n, p in lm.named_parameters() if p.shape[0] == rows] == ["qwen.embed_tokens.weight"]


def test_checkpoint_round_trip_with_tied_text_head(lm: CosyVoice2LM, tmp_path: Path) -> None:
    state = to_checkpoint(lm, lm_checkpoint_table(CFG))
    assert state["llm.model.lm_head.weight"] is state["llm.model.model.embed_tokens.weight"]
    torch.save(state, tmp_path / "llm.pt")
    loaded = CosyVoice2LM(CFG)
    load_checkpoint(loaded, tmp_path / "llm.pt", lm_checkpoint_table(CFG))
    for key, value in lm.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key


def test_misshaped_tensor_names_file_key_and_shapes(lm: CosyVoice2LM, tmp_path: Path) -> None:
    state = to_checkpoint(lm, lm_checkpoint_table(CFG))
    key = "llm.model.model.layers.1.self_attn.k_proj.weight"
    state[key] = torch.zeros(3, 64)
    path = tmp_path / "llm.pt"
    torch.save(state, path)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(CosyVoice2LM(CFG), path, lm_checkpoint_table(CFG))
    message = str(err.value)
    assert str(path) in message and repr(key) in message
    assert "(3, 64)" in message and "(32, 64)" in message


def test_missing_tensor_names_file_and_key(lm: CosyVoice2LM, tmp_path: Path) -> None:
    state = to_checkpoint(lm, lm_checkpoint_table(CFG))
    del state["llm_decoder.bias"]
    path = tmp_path / "llm.pt"
    torch.save(state, path)
    with pytest.raises(CheckpointError, match=r"llm\.pt: missing 1 tensor\(s\), first: 'llm_decoder\.bias'"):
        load_checkpoint(CosyVoice2LM(CFG), path, lm_checkpoint_table(CFG))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_head_laid_out_for_decode_keeps_its_values(lm: CosyVoice2LM, dtype: torch.dtype) -> None:
    row_major = copy.deepcopy(lm).to(dtype)
    laid_out = copy.deepcopy(row_major)
    laid_out.lay_out_head_for_decode_()
    weight = laid_out.llm_decoder.weight
    assert torch.equal(weight, row_major.llm_decoder.weight)
    # float32 only: other dtypes showed no gain and keep the checkpoint's layout.
    assert weight.t().is_contiguous() == (dtype == torch.float32)
    hidden = torch.randn(2, lm.cfg.qwen.hidden_size).to(dtype)
    torch.testing.assert_close(laid_out.speech_log_probs(hidden), row_major.speech_log_probs(hidden))
