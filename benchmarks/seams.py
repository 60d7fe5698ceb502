"""How audible are the joins between streamed chunks? (docs/streaming.md has the numbers.)

One command:

    .venv/bin/python benchmarks/seams.py [MODEL_DIR] [--tokens 100] [--first-hops 10 5]
                                         [--flow-cache incremental cached]

Without MODEL_DIR a tiny random-weight model is generated in a temporary directory.
The same forced speech tokens (seeded, no LM) and the same seed are synthesised once
without streaming and once per streaming schedule: upstream's default (a padded first
hop, then 25-token hops) and each ``--first-hops`` value, for each streaming flow mode
(``EngineConfig.flow_cache``; "exact" and "cached" give the same audio). For every join between two
chunks it measures the step |x[j] - x[j-1]| of the streamed waveform and, at the same
position, of the non-streamed one, and over the whole utterance max |streamed -
non-streamed|, split into the cross-fade zones around the joins and the rest.

The vocoder's noise excitation is random: the engine draws it from the request's
generator call by call, so a streamed and a non-streamed run draw different noise for
the same samples and differ everywhere, joins or not. Every schedule therefore runs twice:
"engine" (the engine as it is) and "aligned" (the vocoder reads its noise from one
utterance-long draw at the absolute sample positions each call covers, so both runs get
the same excitation and only chunking itself, flow and vocoder, can make them differ).
"""

import argparse
import dataclasses
import io
import tempfile
import wave
from pathlib import Path
from typing import cast

import numpy as np
import torch

from cosyserve.engine.config import FLOW_CACHE_MODES, FlowCacheMode
from cosyserve.engine.loader import LoadedModel, engine_config_for, load_model
from cosyserve.models.generate import init_model_dir
from cosyserve.models.hift.generator import HiFTGenerator
from cosyserve.models.hift.source import Excitation
from cosyserve.models.hift.stream import HiFTStreamState, StreamOptions, vocode_chunk
from cosyserve.pipeline.request import Mode, SynthesisOptions, SynthesisRequest
from cosyserve.pipeline.synthesizer import Synthesizer
from cosyserve.pipeline.voice import VoicePrompt

PROMPT_TEXT = "Hello there, how are you?"
CROSSFADE = StreamOptions().overlap  # samples cross-faded (and held back) at each join
SAMPLES_PER_TOKEN = 960
LOCAL = 240  # samples on each side of a join whose steps set its local scale (10 ms)


class AlignedExcitationHiFT:
    """A HiFT whose noise comes from one draw for the whole utterance, by sample position.

    Call by call it tracks where its input starts: a call without ``cache_source`` starts a
    new utterance at 0; a streaming call with it starts ``mel_cache_frames`` before the end
    of the previous call (its first frames are the previous call's last ones).
    """

    def __init__(self, hift: HiFTGenerator, frames: int, seed: int) -> None:
        self.hift = hift
        self.cfg = hift.cfg
        samples = frames * hift.cfg.upsample_factor
        generator = torch.Generator().manual_seed(seed)
        self.noise = Excitation.draw(1, hift.cfg.nb_harmonics + 1, samples, generator).noise
        self._end = 0  # frame after the previous call's last one

    def inference(
        self, mel: torch.Tensor, cache_source: torch.Tensor | None = None, *, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        frames, hop = mel.shape[2], self.cfg.upsample_factor
        cached = 0 if cache_source is None else cache_source.shape[2] // hop
        start = self._end - cached if cached else 0
        self._end = start + frames
        noise = self.noise[:, :, start * hop : self._end * hop]
        return self.hift.inference(mel, cache_source, excitation=Excitation(noise=noise))


def prompt_wav(seconds: float, rate: int = 16000, seed: int = 0) -> bytes:
    """A speech-like prompt (gliding harmonics, syllable-rate envelope, a little noise)."""
    gen = np.random.default_rng(seed)
    t = np.arange(round(seconds * rate)) / rate
    phase = 2 * np.pi * np.cumsum(130 + 30 * np.sin(2 * np.pi * 1.3 * t)) / rate
    voiced = sum(np.sin(k * phase) / k for k in range(1, 6))
    signal = 0.15 * (0.55 + 0.45 * np.sin(2 * np.pi * 4 * t)) * voiced + 0.01 * gen.standard_normal(t.size)
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((np.clip(signal, -1, 1) * 32767).astype("<i2").tobytes())
    return out.getvalue()


@dataclasses.dataclass(frozen=True)
class Run:
    """What every synthesis of one comparison shares."""

    voice: VoicePrompt
    tokens: tuple[int, ...]
    seed: int
    flow_cache: FlowCacheMode

    def chunks(self, model: LoadedModel, stream: bool, first_hop: int | None = None) -> list[np.ndarray]:
        """The chunks of one request (one chunk without streaming), on a fresh engine."""
        opts = SynthesisOptions(seed=self.seed, first_hop=first_hop)
        request = SynthesisRequest(
            "", Mode.ZERO_SHOT, self.voice, speech_tokens=self.tokens, stream=stream, options=opts
        )
        config = engine_config_for(model, max_active=1, flow_cache=self.flow_cache)
        return list(Synthesizer(model, config).stream(request))


def hops_of(chunks: list[np.ndarray]) -> list[int]:
    """Tokens per chunk: the first chunk held back the cross-fade, the last released it."""
    sizes = [c.size for c in chunks]
    if len(sizes) > 1:
        sizes[0] += CROSSFADE
        sizes[-1] -= CROSSFADE
    return [n // SAMPLES_PER_TOKEN for n in sizes]


@torch.inference_mode()
def vocoder_only(
    model: LoadedModel, voice: VoicePrompt, tokens: tuple[int, ...], hops: list[int], seed: int
) -> tuple[list[np.ndarray], np.ndarray]:
    """The non-streamed mel vocoded whole and chunk by chunk (``hops``) with the streaming
    vocoder, both on the aligned excitation: the vocoder's own seams, without the flow's."""
    mel = model.flow.inference(
        torch.tensor([tokens]), voice.speech_tokens[None], voice.mel[None], voice.embedding[None], False, True
    )  # (1, 80, 2 N)
    unused = torch.Generator()
    whole, _ = AlignedExcitationHiFT(model.hift, mel.shape[2], seed).inference(mel, None, generator=unused)
    streaming = cast(HiFTGenerator, AlignedExcitationHiFT(model.hift, mel.shape[2], seed))
    state, chunks, start = HiFTStreamState(), [], 0
    for index, hop in enumerate(hops):
        part = mel[:, :, 2 * start : 2 * (start + hop)]
        final = index == len(hops) - 1
        chunks.append(vocode_chunk(streaming, state, part, finalize=final, generator=unused)[0].numpy())
        start += hop
    return chunks, whole[0].numpy()


def join_steps(x: np.ndarray, joins: np.ndarray) -> tuple[float, float]:
    """Max |x[j] - x[j-1]| over the joins, and max of that step over the RMS of the steps
    within 10 ms around it (the join's own step left out): near 1-3 for a step like its
    neighbours, far above for a click."""
    steps = np.abs(np.diff(x))  # steps[j - 1] = |x[j] - x[j-1]|
    ratios = []
    for j in joins:
        around = np.r_[steps[max(j - 1 - LOCAL, 0) : j - 1], steps[j : j + LOCAL]]
        ratios.append(steps[j - 1] / max(float(np.sqrt(np.mean(around**2))), 1e-9))
    return float(steps[joins - 1].max()), max(ratios)


def seam_row(mode: str, schedule: str, comparison: str, chunks: list[np.ndarray], whole: np.ndarray) -> str:
    streamed = np.concatenate(chunks)
    assert streamed.shape == whole.shape, "streamed and non-streamed lengths differ"
    joins = np.cumsum([c.size for c in chunks])[:-1]
    step_s, ratio_s = join_steps(streamed, joins)
    step_w, ratio_w = join_steps(whole, joins)
    diff = np.abs(streamed - whole)
    near = np.zeros(diff.size, dtype=bool)
    for j in joins:
        near[max(j - CROSSFADE, 0) : j + CROSSFADE] = True
    hops = "+".join(map(str, hops_of(chunks)))
    return (
        f"| {mode} | {schedule} | {comparison} | {hops} | {step_s:.4f} / {step_w:.4f} "
        f"| {ratio_s:.1f} / {ratio_w:.1f} | {diff[near].max():.2e} | {diff[~near].max():.2e} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("model_dir", nargs="?", type=Path, help="default: a tiny model in a temp dir")
    parser.add_argument("--tokens", type=int, default=100, help="forced speech tokens (default 100 = 4 s)")
    parser.add_argument("--first-hops", type=int, nargs="*", default=[10, 5])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--flow-cache",
        nargs="+",
        choices=FLOW_CACHE_MODES,
        default=["incremental", "cached"],
        help="flow modes",
    )
    parser.add_argument("--prompt-seconds", type=float, default=3.0)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_dir
        if model_dir is None:
            model_dir = Path(tmp) / "tiny"
            init_model_dir(model_dir, "tiny", seed=0)
        model = load_model(model_dir)
        voice = Synthesizer(model).voice_from_audio(prompt_wav(args.prompt_seconds), PROMPT_TEXT)
    gen = torch.Generator().manual_seed(args.seed)
    tokens = tuple(
        torch.randint(0, model.hparams.lm.speech_token_size, (args.tokens,), generator=gen).tolist()
    )
    frames = 2 * args.tokens

    def aligned_model() -> LoadedModel:
        """The model with a vocoder that reads the aligned noise (fresh for every run)."""
        aligned = AlignedExcitationHiFT(model.hift, frames, seed=args.seed)
        return dataclasses.replace(model, hift=cast(HiFTGenerator, aligned))

    print(f"model {args.model_dir or 'tiny (generated)'}; prompt {voice.speech_tokens.numel()} tokens; "
          f"{args.tokens} forced tokens ({args.tokens * 0.04:.2f} s); seed {args.seed}")  # fmt: skip
    print()
    print(
        "| flow_cache | schedule | streamed vs non-streamed | chunks (tokens) | max join step: streamed / "
        "non-streamed | max join step / local RMS step: streamed / non-streamed "
        "| max diff, <=160 ms from a join | max diff elsewhere |"
    )
    print("|---|---|---|---|---|---|---|---|")
    streams: dict[tuple[str, str], list[np.ndarray]] = {}
    for mode in args.flow_cache:
        run = Run(voice, tokens, args.seed, mode)
        (whole,) = run.chunks(model, stream=False)
        (whole_aligned,) = run.chunks(aligned_model(), stream=False)
        for first_hop in [None, *args.first_hops]:
            schedule = "default" if first_hop is None else f"first_hop={first_hop}"
            chunks = streams[mode, schedule] = run.chunks(model, stream=True, first_hop=first_hop)
            print(seam_row(mode, schedule, "engine", chunks, whole))
            aligned = run.chunks(aligned_model(), stream=True, first_hop=first_hop)
            print(seam_row(mode, schedule, "aligned excitation", aligned, whole_aligned))
            vocoded = vocoder_only(model, voice, tokens, hops_of(chunks), args.seed)
            print(seam_row(mode, schedule, "vocoder only", *vocoded))
    print()
    reference, *others = args.flow_cache
    for (mode, schedule), chunks in streams.items():
        if mode in others:
            diffs = [np.abs(a - b).max() for a, b in zip(chunks, streams[reference, schedule], strict=True)]
            per_chunk = ", ".join(f"{d:.2e}" for d in diffs)
            print(f"{schedule}: max |{mode} - {reference}| per streamed chunk: {per_chunk}")


if __name__ == "__main__":
    main()
