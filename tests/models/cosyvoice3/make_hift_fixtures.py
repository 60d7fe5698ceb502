"""Make the CosyVoice 3 vocoder parity fixtures from upstream FunAudioLLM/CosyVoice at commit ace7c47.

Command (from the repository root; tiny always, full with ``--full``)::

    COSYVOICE3_UPSTREAM=/tmp/upstream COSYVOICE3_SITE=/tmp/upv3-site OMP_NUM_THREADS=1 \\
        .venv/bin/python -m tests.models.cosyvoice3.make_hift_fixtures [--full]

What it does, per geometry (``TINY3`` -> ``fixtures/hift-tiny.pt``, ``FULL3`` ->
``fixtures/hift-full.pt``):

1. builds our :class:`CausalHiFTGenerator` with :func:`our_hift` (preset, ``randomize_``
   from ``Generator().manual_seed(SEED)``, then the f0 shifted into the voiced range and
   ``conv_post`` quietened, as CosyVoice 2's HiFT parity test does) and writes the official
   ``hift.pt`` state dict through :func:`causal_hift_checkpoint_table`;
2. builds upstream's ``CausalHiFTGenerator`` + ``CausalConvRNNF0Predictor`` with the
   arguments of ``cosyvoice3.yaml`` for that geometry, loads the state dict with
   ``load_state_dict(strict=True)``, and replaces its noise table (``sine_waves``, drawn
   from the global RNG when built) by ours, :func:`noise_window` of ``NOISE_SEED``;
3. runs, on a seeded random mel: the f0 predictor (float64) with ``finalize`` True and
   False; ``inference`` with both (keeping wave and source: the source is the excitation
   our ``decode`` is fed, and, the noise table being shared, what ours must make); and
   ``CosyVoice3Model.token2wav`` (the real one, with a stand-in flow returning the mel of
   the tokens) over chunks of ``CHUNK_TOKENS`` tokens (``2 * CHUNK_TOKENS`` mel frames),
   which re-runs the vocoder over all accumulated mel per chunk and emits the new samples;
4. saves the inputs, those outputs and upstream's state-dict key -> shape list.
"""

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cosyserve.modeldir.hparams3 import HiFT3Config, Model3HParams
from cosyserve.modeldir.presets import FULL3, TINY3
from cosyserve.models.hift3 import CausalHiFTGenerator, causal_hift_checkpoint_table, noise_window
from cosyserve.weights.checkpoint import to_checkpoint
from cosyserve.weights.randomize import randomize_

FIXTURES = Path(__file__).parent / "fixtures"
SEED = 11
NOISE_SEED = 3
MEL_SEED = 12
CHUNK_TOKENS = 25  # CosyVoice3Model.token_hop_len: 50 mel frames per chunk


@dataclass(frozen=True)
class Geometry:
    hp: Model3HParams
    frames: int  # mel frames of the one-call cases (f0, inference, decode)
    chunks: tuple[int, ...]  # tokens per streaming chunk, the last one final
    name: str


TINY_CASE = Geometry(TINY3, frames=40, chunks=(CHUNK_TOKENS, CHUNK_TOKENS, 15), name="tiny")
FULL_CASE = Geometry(FULL3, frames=20, chunks=(CHUNK_TOKENS, CHUNK_TOKENS, 10), name="full")


def our_hift(cfg: HiFT3Config) -> CausalHiFTGenerator:
    """Our vocoder with the fixtures' weights."""
    hift = CausalHiFTGenerator(cfg).eval()
    randomize_(hift, torch.Generator().manual_seed(SEED))
    with torch.no_grad():
        # Random weights give f0 near 0 Hz, all unvoiced, which would leave the sines out
        # of the comparison; shift it to 0..100 Hz, mostly voiced. Quieten conv_post so
        # that the waveform is not clipped at audio_limit (clipped samples compare trivially).
        hift.f0_predictor.classifier.weight.mul_(60.0)
        hift.f0_predictor.classifier.bias.fill_(40.0)
        hift.conv_post.weight.mul_(0.3)
        assert hift.conv_post.bias is not None
        hift.conv_post.bias.sub_(0.5)
    return hift


def total_frames(case: Geometry) -> int:
    return 2 * sum(case.chunks)


def fixture_mel(case: Geometry) -> torch.Tensor:
    generator = torch.Generator().manual_seed(MEL_SEED)
    return torch.randn(1, case.hp.hift.in_channels, total_frames(case), generator=generator)


class _FlowStub:
    """Stands in for upstream's flow in ``token2wav``: the mel of the first 2 * n tokens."""

    token_mel_ratio = 2

    def __init__(self, mel: torch.Tensor) -> None:
        self.mel = mel

    def inference(self, token: torch.Tensor, **_: Any) -> tuple[torch.Tensor, None]:
        return self.mel[:, :, : self.token_mel_ratio * token.shape[1]], None


def _upstream_hift(cfg: HiFT3Config) -> Any:
    from tests.upstream3 import upstream3

    generator = upstream3("cosyvoice.hifigan.generator")
    f0 = upstream3("cosyvoice.hifigan.f0_predictor")
    return generator.CausalHiFTGenerator(
        in_channels=cfg.in_channels,
        base_channels=cfg.base_channels,
        nb_harmonics=cfg.nb_harmonics,
        sampling_rate=cfg.sampling_rate,
        nsf_alpha=cfg.nsf_alpha,
        nsf_sigma=cfg.nsf_sigma,
        nsf_voiced_threshold=cfg.nsf_voiced_threshold,
        upsample_rates=list(cfg.upsample_rates),
        upsample_kernel_sizes=list(cfg.upsample_kernel_sizes),
        istft_params={"n_fft": cfg.istft_n_fft, "hop_len": cfg.istft_hop_len},
        resblock_kernel_sizes=list(cfg.resblock_kernel_sizes),
        resblock_dilation_sizes=[list(d) for d in cfg.resblock_dilation_sizes],
        source_resblock_kernel_sizes=list(cfg.source_resblock_kernel_sizes),
        source_resblock_dilation_sizes=[list(d) for d in cfg.source_resblock_dilation_sizes],
        lrelu_slope=cfg.lrelu_slope,
        audio_limit=cfg.audio_limit,
        conv_pre_look_right=cfg.conv_pre_look_right,
        f0_predictor=f0.CausalConvRNNF0Predictor(
            num_class=cfg.f0_num_class, in_channels=cfg.f0_in_channels, cond_channels=cfg.f0_cond_channels
        ),
    )


def _stream(theirs: Any, mel: torch.Tensor, chunks: tuple[int, ...]) -> list[torch.Tensor]:
    from tests.upstream3 import upstream3

    model = upstream3("cosyvoice.cli.model").CosyVoice3Model(None, _FlowStub(mel), theirs)
    model.hift_cache_dict["request"] = None
    outputs, offset = [], 0
    for index, tokens in enumerate(chunks):
        final = index == len(chunks) - 1
        outputs.append(
            model.token2wav(
                token=torch.zeros(1, offset + tokens, dtype=torch.int32),
                prompt_token=torch.zeros(1, 0, dtype=torch.int32),
                prompt_feat=torch.zeros(1, 0, 80),
                embedding=torch.zeros(1, 192),
                token_offset=offset,
                uuid="request",
                stream=not final,
                finalize=final,
            )
        )
        offset += tokens
    return outputs


def make(case: Geometry) -> dict[str, Any]:
    cfg = case.hp.hift
    ours = our_hift(cfg)
    theirs = _upstream_hift(cfg)
    theirs.load_state_dict(to_checkpoint(ours, causal_hift_checkpoint_table(cfg)), strict=True)
    theirs.eval()
    samples = total_frames(case) * cfg.upsample_factor
    theirs.m_source.l_sin_gen.sine_waves = noise_window(NOISE_SEED, cfg.nb_harmonics + 1, 0, samples)[None]
    mel = fixture_mel(case)
    short = mel[:, :, : case.frames]
    data: dict[str, Any] = {
        "state_shapes": [(k, tuple(v.shape)) for k, v in theirs.state_dict().items()],
        "mel": mel,
        "frames": case.frames,
        "chunks": case.chunks,
    }
    with torch.inference_mode():
        theirs.f0_predictor.to(torch.float64)
        for finalize in (True, False):
            tag = "final" if finalize else "partial"
            data[f"f0_{tag}"] = theirs.f0_predictor(short.to(torch.float64), finalize=finalize).clone()
            wave, source = theirs.inference(short, finalize=finalize)
            data[f"wave_{tag}"], data[f"source_{tag}"] = wave.clone(), source.clone()
    with torch.inference_mode():
        # Clones: a slice saved as it is would carry its whole storage into the file.
        data["stream"] = [chunk.clone() for chunk in _stream(theirs, mel, case.chunks)]
    voiced = float((data["f0_final"] > cfg.nsf_voiced_threshold).double().mean())
    clipped = float((data["wave_final"].abs() >= cfg.audio_limit).float().mean())
    print(f"{case.name}: voiced frames {voiced:.2f}, clipped samples {clipped:.4f}")
    return data


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--full", action="store_true", help="also make the full-geometry fixture")
    args = parser.parse_args()
    FIXTURES.mkdir(exist_ok=True)
    for case in (TINY_CASE, FULL_CASE) if args.full else (TINY_CASE,):
        path = FIXTURES / f"hift-{case.name}.pt"
        torch.save(make(case), path)
        print(f"wrote {path} ({path.stat().st_size / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
