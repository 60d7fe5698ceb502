"""Make the CosyVoice 3 flow parity fixtures from upstream FunAudioLLM/CosyVoice at commit ace7c47.

Command (from the repository root; tiny always, full with ``--full``)::

    COSYVOICE3_UPSTREAM=/tmp/upstream COSYVOICE3_SITE=/tmp/upv3-site OMP_NUM_THREADS=1 \\
        .venv/bin/python -m tests.models.cosyvoice3.make_flow_fixtures [--full]

What it does, per geometry (``TINY3`` -> ``fixtures/flow-tiny.pt``, ``FULL3`` ->
``fixtures/flow-full.pt``):

1. builds our :class:`Flow3` from the preset, fills it with
   ``randomize_(..., Generator().manual_seed(SEED))`` and writes the official ``flow.pt``
   state dict through :func:`flow3_checkpoint_table`;
2. builds upstream's ``CausalMaskedDiffWithDiT`` (``PreLookaheadLayer``,
   ``CausalConditionalCFM``, ``DiT``) with the arguments of ``cosyvoice3.yaml`` for that
   geometry and loads the state dict with ``load_state_dict(strict=True)``;
3. runs upstream's ``inference`` on fixed inputs: non-streaming with and without a voice
   prompt, and every call of the streaming schedule of ``CosyVoice3Model.tts`` /
   ``token2wav`` (:func:`stream_calls`: hop 25 tokens, the first padded so that prompt +
   hop is a multiple of 25, doubling up to 100; 3 look-ahead tokens and
   ``finalize=False`` for each call but the last, which runs ``finalize=True`` without
   streaming), keeping each call's mel after its ``token_offset``; plus the last call
   with chunk-causal attention (``streaming=True, finalize=True``);
4. saves inputs, those mels and the state dict's key -> shape list.
"""

import argparse
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cosyserve.modeldir.hparams3 import Flow3Config, Model3HParams
from cosyserve.modeldir.presets import FULL3, TINY3
from cosyserve.models.dit import Flow3, flow3_checkpoint_table
from cosyserve.weights.checkpoint import to_checkpoint
from cosyserve.weights.randomize import randomize_

FIXTURES = Path(__file__).parent / "fixtures"
SEED = 5
# CosyVoice3Model constants: first hop, its cap and growth factor; flow.pre_lookahead_len.
TOKEN_HOP = 25
TOKEN_MAX_HOP = 100
STREAM_SCALE = 2
LOOKAHEAD = 3


@dataclass(frozen=True)
class Geometry:
    hp: Model3HParams
    prompt_tokens: int
    tokens: int
    name: str


TINY_CASE = Geometry(TINY3, prompt_tokens=10, tokens=240, name="tiny")
FULL_CASE = Geometry(FULL3, prompt_tokens=25, tokens=60, name="full")


@dataclass(frozen=True)
class StreamCall:
    """One ``token2wav`` call: tokens ``[:end]``, mel kept from ``offset`` tokens on."""

    end: int
    offset: int
    finalize: bool


def stream_calls(prompt_len: int, n_tokens: int) -> list[StreamCall]:
    """The ``token2wav`` calls of upstream's ``CosyVoice3Model.tts(stream=True)`` (a fresh
    model) once all ``n_tokens`` are generated."""
    pad = math.ceil(prompt_len / TOKEN_HOP) * TOKEN_HOP - prompt_len
    calls, offset, hop_len = [], 0, TOKEN_HOP
    while True:
        hop = hop_len + pad if offset == 0 else hop_len
        if n_tokens - offset < hop + LOOKAHEAD:
            break
        calls.append(StreamCall(offset + hop + LOOKAHEAD, offset, False))
        offset += hop
        hop_len = min(TOKEN_MAX_HOP, hop_len * STREAM_SCALE)
    calls.append(StreamCall(n_tokens, offset, True))
    return calls


def make_inputs(case: Geometry) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(SEED + 100)
    cfg = case.hp.flow
    return {
        "token": torch.randint(0, cfg.vocab_size, (1, case.tokens), generator=gen),
        "prompt_token": torch.randint(0, cfg.vocab_size, (1, case.prompt_tokens), generator=gen),
        "prompt_feat": torch.randn(
            1, case.prompt_tokens * cfg.token_mel_ratio, cfg.output_size, generator=gen
        ),
        "embedding": torch.randn(1, cfg.spk_embed_dim, generator=gen),
    }


def our_flow(cfg: Flow3Config) -> Flow3:
    flow = Flow3(cfg)
    randomize_(flow, torch.Generator().manual_seed(SEED))
    return flow.eval()


def upstream_flow(cfg: Flow3Config) -> Any:
    from omegaconf import DictConfig

    from tests.upstream3 import upstream3

    flow_mod = upstream3("cosyvoice.flow.flow")
    matching = upstream3("cosyvoice.flow.flow_matching")
    dit_mod = upstream3("cosyvoice.flow.DiT.dit")
    encoder = upstream3("cosyvoice.transformer.upsample_encoder")
    d = cfg.dit
    estimator = dit_mod.DiT(
        dim=d.dim,
        depth=d.depth,
        heads=d.heads,
        dim_head=d.dim_head,
        ff_mult=d.ff_mult,
        mel_dim=d.mel_dim,
        mu_dim=d.mu_dim,
        spk_dim=d.spk_dim,
        out_channels=d.out_channels,
        static_chunk_size=d.static_chunk_size,
        num_decoding_left_chunks=d.num_decoding_left_chunks,
    )
    cfm_params = DictConfig(
        {
            "sigma_min": cfg.cfm.sigma_min,
            "solver": "euler",
            "t_scheduler": cfg.cfm.t_scheduler,
            "training_cfg_rate": 0.2,
            "inference_cfg_rate": cfg.cfm.inference_cfg_rate,
            "reg_loss_type": "l1",
        }
    )
    # CausalConditionalCFM reseeds the global RNGs while it is built.
    with torch.random.fork_rng():
        decoder = matching.CausalConditionalCFM(
            in_channels=cfg.cfm.in_channels,
            cfm_params=cfm_params,
            n_spks=1,
            spk_emb_dim=cfg.cfm.spk_emb_dim,
            estimator=estimator,
        )
    lookahead = encoder.PreLookaheadLayer(
        in_channels=cfg.input_size,
        channels=cfg.pre_lookahead_channels,
        pre_lookahead_len=cfg.pre_lookahead_len,
    )
    return flow_mod.CausalMaskedDiffWithDiT(
        input_size=cfg.input_size,
        output_size=cfg.output_size,
        spk_embed_dim=cfg.spk_embed_dim,
        output_type="mel",
        vocab_size=cfg.vocab_size,
        input_frame_rate=cfg.input_frame_rate,
        only_mask_loss=True,
        token_mel_ratio=cfg.token_mel_ratio,
        pre_lookahead_len=cfg.pre_lookahead_len,
        pre_lookahead_layer=lookahead,
        decoder=decoder,
    )


def run_upstream(flow: Any, x: dict[str, torch.Tensor], token: torch.Tensor, **kw: Any) -> torch.Tensor:
    def length(t: torch.Tensor) -> torch.Tensor:
        return torch.tensor([t.shape[1]], dtype=torch.int32)

    prompt_token, prompt_feat = (
        kw.pop("prompt_token", x["prompt_token"]),
        kw.pop("prompt_feat", x["prompt_feat"]),
    )
    mel, _ = flow.inference(
        token=token.to(torch.int32),
        token_len=length(token),
        prompt_token=prompt_token.to(torch.int32),
        prompt_token_len=length(prompt_token),
        prompt_feat=prompt_feat,
        prompt_feat_len=length(prompt_feat),
        embedding=x["embedding"],
        **kw,
    )
    return mel.float().clone()


def make(case: Geometry) -> dict[str, Any]:
    from tests.upstream3 import UPSTREAM_COMMIT

    cfg = case.hp.flow
    state = to_checkpoint(our_flow(cfg), flow3_checkpoint_table(cfg))
    theirs = upstream_flow(cfg)
    theirs.load_state_dict(state, strict=True)
    theirs.eval()
    x = make_inputs(case)
    token = x["token"]
    no_prompt = {"prompt_token": token[:, :0], "prompt_feat": x["prompt_feat"][:, :0]}
    ratio = cfg.token_mel_ratio
    chunks = []
    for call in stream_calls(case.prompt_tokens, case.tokens):
        # token2wav: stream=True except for the final call, which passes no stream (False).
        mel = run_upstream(
            theirs, x, token[:, : call.end], streaming=not call.finalize, finalize=call.finalize
        )
        chunks.append(mel[:, :, call.offset * ratio :].clone())
        print(f"{case.name}: call {call} -> {tuple(chunks[-1].shape)}", flush=True)
    last = stream_calls(case.prompt_tokens, case.tokens)[-1]
    causal_last = run_upstream(theirs, x, token, streaming=True, finalize=True)[:, :, last.offset * ratio :]
    return {
        "upstream_commit": UPSTREAM_COMMIT,
        "seed": SEED,
        "inputs": x,
        "state_shapes": [(k, tuple(v.shape)) for k, v in theirs.state_dict().items()],
        "mel_prompt": run_upstream(theirs, x, token, streaming=False, finalize=True),
        "mel_no_prompt": run_upstream(theirs, x, token, streaming=False, finalize=True, **no_prompt),
        "stream_chunks": chunks,
        "causal_last_chunk": causal_last.clone(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="also make the full-geometry fixture")
    args = parser.parse_args()
    FIXTURES.mkdir(exist_ok=True)
    torch.set_grad_enabled(False)
    for case in (TINY_CASE, FULL_CASE) if args.full else (TINY_CASE,):
        path = FIXTURES / f"flow-{case.name}.pt"
        torch.save(make(case), path)
        print(f"wrote {path} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
