"""Make the CosyVoice 3 LM parity fixtures from upstream FunAudioLLM/CosyVoice at commit ace7c47.

Command (from the repository root; tiny always, full with ``--full``)::

    COSYVOICE3_UPSTREAM=/tmp/upstream COSYVOICE3_SITE=/tmp/upv3-site OMP_NUM_THREADS=1 \\
        .venv/bin/python -m tests.models.cosyvoice3.make_lm_fixtures [--full]

What it does, per geometry (``TINY3`` -> ``fixtures/lm-tiny.pt``, ``FULL3`` ->
``fixtures/lm-full.pt``):

1. builds our :class:`CosyVoice3LM` from the preset, fills it with
   ``randomize_(..., Generator().manual_seed(SEED))`` and writes the official ``llm.pt``
   state dict through :func:`lm3_checkpoint_table`;
2. writes a ``CosyVoice-BlankEN`` directory (config.json + weights) as ``cosyserve model
   init`` does and builds upstream's ``CosyVoice3LM`` over ``Qwen2Encoder`` on it, then
   loads the state dict with ``load_state_dict(strict=True)``;
3. runs upstream's own ``inference`` (prompt layout, ``inference_wrapper``'s non-vLLM
   loop through ``Qwen2Encoder.forward_one_step``, ``llm_decoder``, ``log_softmax``) with
   its ``sampling_ids`` replaced by a recorder that keeps each step's log-probs and
   returns the next of a fixed list of tokens (teacher forcing);
4. records what upstream's ``sampling_ids(ignore_eos=True)`` masks, its stop ids and the
   state dict's key -> shape list, and saves inputs + those outputs.

``forward_one_step`` gets an all-ones attention mask over cache + new positions, which is
what upstream's (1, 1) decode-step mask means under transformers 4.51 (its supported
version) but which transformers 5 misreads (as ``tests/models/test_lm_parity.py`` does).
"""

import argparse
import tempfile
from pathlib import Path
from typing import Any

import torch

from cosyserve.modeldir.hparams3 import Model3HParams
from cosyserve.modeldir.presets import FULL3, TINY3
from cosyserve.modeldir.qwen_files import write_qwen_config, write_qwen_weights
from cosyserve.models.lm3 import CosyVoice3LM, lm3_checkpoint_table
from cosyserve.weights.checkpoint import to_checkpoint
from cosyserve.weights.randomize import randomize_
from tests.upstream3 import UPSTREAM_COMMIT, upstream3

FIXTURES = Path(__file__).parent / "fixtures"
SEED = 3
ENDOFPROMPT_ID = 151646  # upstream's CosyVoice 3 inference asserts it is in the text


def make_inputs(hp: Model3HParams) -> dict[str, torch.Tensor]:
    """Fixed prompt text (ending in <|endofprompt|>), text, prompt speech and forced tokens."""
    gen = torch.Generator().manual_seed(SEED + 100)
    vocab, speech = hp.lm.qwen.vocab_size, hp.lm.speech_token_size
    prompt_text = torch.cat([torch.randint(0, 151643, (5,), generator=gen), torch.tensor([ENDOFPROMPT_ID])])
    return {
        "prompt_text": prompt_text,
        "text": torch.randint(0, vocab, (9,), generator=gen),
        "prompt_speech": torch.randint(0, speech, (7,), generator=gen),
        # Decode inputs after the prefill: ordinary codes, a repeat and the top code.
        "forced": torch.tensor([17, 17, 6000, 3, 250, speech - 1]),
    }


def _full_mask_step(encoder: Any) -> Any:
    original = encoder.forward_one_step

    def step(xs: torch.Tensor, masks: torch.Tensor, cache: Any = None) -> Any:
        past = 0 if cache is None else cache.get_seq_length()
        return original(xs, torch.ones(1, 1, past + xs.shape[1], dtype=torch.bool), cache)

    return step


@torch.no_grad()
def make(hp: Model3HParams, name: str) -> None:
    cfg = hp.lm
    ours = CosyVoice3LM(cfg)
    randomize_(ours, torch.Generator().manual_seed(SEED))
    state = to_checkpoint(ours, lm3_checkpoint_table(cfg))
    del ours

    llm_mod = upstream3("cosyvoice.llm.llm")
    common = upstream3("cosyvoice.utils.common")
    with tempfile.TemporaryDirectory() as tmp:
        blank_en = Path(tmp) / "CosyVoice-BlankEN"
        blank_en.mkdir()
        write_qwen_config(blank_en, cfg.qwen)
        write_qwen_weights(blank_en, state)
        theirs = llm_mod.CosyVoice3LM(
            llm_input_size=cfg.llm_input_size,
            llm_output_size=cfg.llm_output_size,
            speech_token_size=cfg.speech_token_size,
            llm=llm_mod.Qwen2Encoder(str(blank_en)),
            sampling=common.ras_sampling,
        )
    theirs.float()  # from_pretrained keeps config.json's bfloat16; compare in float32
    theirs.load_state_dict(state, strict=True)
    theirs.eval()
    del state
    theirs.llm.forward_one_step = _full_mask_step(theirs.llm)

    inputs = make_inputs(hp)
    forced = inputs["forced"].tolist()
    log_probs: list[torch.Tensor] = []
    prompt_inputs: list[torch.Tensor] = []
    original_wrapper = theirs.inference_wrapper

    def wrapper(lm_input: torch.Tensor, *args: Any) -> Any:
        prompt_inputs.append(lm_input[0].clone())
        return original_wrapper(lm_input, *args)

    def record(
        weighted_scores: torch.Tensor, decoded: list[int], sampling: int, ignore_eos: bool = True
    ) -> int:
        log_probs.append(weighted_scores.clone())
        return forced[len(decoded)] if len(decoded) < len(forced) else cfg.eos

    theirs.inference_wrapper = wrapper
    theirs.sampling_ids = record
    emitted = list(
        theirs.inference(
            inputs["text"][None], torch.tensor([len(inputs["text"])]),
            inputs["prompt_text"][None], torch.tensor([len(inputs["prompt_text"])]),
            inputs["prompt_speech"][None], torch.tensor([len(inputs["prompt_speech"])]),
            torch.zeros(1, 192),
            max_token_text_ratio=float(len(forced) + 1),  # enough steps for every forced token
        )
    )  # fmt: skip
    assert emitted == forced, emitted

    # What upstream's sampling_ids masks below the minimum length, on finite scores.
    masked: list[torch.Tensor] = []
    del theirs.sampling_ids  # back to the class method
    theirs.sampling = lambda scores, decoded, sampling: masked.append(scores.clone()) or 0
    theirs.sampling_ids(torch.zeros(cfg.num_speech_ids), [], 25, ignore_eos=True)
    masked_ids = torch.nonzero(torch.isinf(masked[0]))[:, 0]

    fixture = {
        "upstream_commit": UPSTREAM_COMMIT,
        "seed": SEED,
        **inputs,
        "prompt_embeddings": prompt_inputs[0],  # (T, H) what inference fed the wrapper
        "log_probs": torch.stack(log_probs),  # (1 + len(forced), V): prefill, then each step
        "masked_below_min_len": masked_ids,
        "stop_token_ids": torch.tensor(theirs.stop_token_ids),
        "upstream_shapes": {k: tuple(v.shape) for k, v in theirs.state_dict().items()},
    }
    FIXTURES.mkdir(exist_ok=True)
    path = FIXTURES / f"lm-{name}.pt"
    torch.save(fixture, path)
    print(f"wrote {path} ({path.stat().st_size / 1e6:.2f} MB)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--full", action="store_true", help="also make the full-geometry fixture")
    args = parser.parse_args()
    torch.manual_seed(0)
    make(TINY3, "tiny")
    if args.full:
        make(FULL3, "full")


if __name__ == "__main__":
    main()
