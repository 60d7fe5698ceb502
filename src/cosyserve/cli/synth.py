"""The ``cosyserve synth`` command: one synthesis into a WAV file, timed stage by stage.

The mode follows from the inputs unless ``--mode`` names it, and every mode takes exactly
the inputs listed in :data:`MODE_INPUTS`: a missing one or one the mode would ignore is an
error, so a mistyped command never synthesises something else than was meant.

What is timed and how: :mod:`cosyserve.cli.synth_report`.
"""

import json
import resource
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import numpy as np
import soundfile as sf
import typer
from typer._click.core import Context  # typer 0.29 vendors click and re-exports neither
from typer._click.exceptions import UsageError
from typer.core import TyperCommand

from cosyserve.accel.precision_choices import Choices, Dtype, FlowQuantization, Profile, Quantization
from cosyserve.cli.precision import (
    device_option,
    dtype_option,
    flow_quantize_option,
    profile_option,
    quantize_option,
)
from cosyserve.cli.synth_report import StageCounters, SynthReport
from cosyserve.errors import InvalidRequestError, PromptAudioError
from cosyserve.paths import default_model_dir, require_model_dir

if TYPE_CHECKING:
    from cosyserve.pipeline.request import SynthesisRequest
    from cosyserve.pipeline.synthesizer import Synthesizer

_T = TypeVar("_T")


class ModeName(StrEnum):
    """The CLI's copy of :class:`cosyserve.pipeline.request.Mode` (that module imports
    torch, which ``--help`` should not wait for); a test keeps the two equal."""

    zero_shot = "zero_shot"
    cross_lingual = "cross_lingual"
    instruct2 = "instruct2"
    sft = "sft"
    vc = "vc"


# What each mode reads; all of them are required, anything else given is an error.
MODE_INPUTS: dict[ModeName, frozenset[str]] = {
    ModeName.zero_shot: frozenset({"TEXT", "--prompt-wav", "--prompt-text"}),
    ModeName.cross_lingual: frozenset({"TEXT", "--prompt-wav"}),
    ModeName.instruct2: frozenset({"TEXT", "--prompt-wav", "--instruct"}),
    ModeName.sft: frozenset({"TEXT", "--speaker"}),
    ModeName.vc: frozenset({"--prompt-wav", "--source-wav"}),
}


@dataclass(frozen=True)
class AudioFile:
    """An input recording, read before the model loads so that a wrong path fails at once."""

    option: str
    path: Path
    data: bytes

    @classmethod
    def read(cls, option: str, path: Path) -> "AudioFile":
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise PromptAudioError(f"cannot read {option} {path}: {exc.strerror or 'unreadable'}") from None
        if not data:
            raise PromptAudioError(f"{option} {path} is empty")
        return cls(option, path, data)

    def decode(self, work: Callable[[bytes], _T]) -> _T:
        """``work(data)``, naming this file when its audio is unusable."""
        try:
            return work(self.data)
        except PromptAudioError as exc:
            raise PromptAudioError(f"{self.option} {self.path}: {exc}") from None


@dataclass(frozen=True)
class Job:
    """A checked command line."""

    mode: ModeName
    text: str
    prompt: AudioFile | None
    prompt_text: str
    speaker: str | None
    instruct: str
    source: AudioFile | None
    stream: bool
    seed: int
    speed: float
    min_tokens: int | None
    max_tokens: int | None
    first_hop: int | None
    profile: Profile
    choices: Choices


class _OneLineErrors(TyperCommand):
    """Turns click's usage errors (bad number, unknown option, ...) into an
    :class:`InvalidRequestError`, which the root app prints as one ``error:`` line."""

    def make_context(
        self, info_name: str | None, args: list[str], parent: Context | None = None, **extra: Any
    ) -> Context:
        try:
            return super().make_context(info_name, args, parent, **extra)
        except UsageError as exc:
            hint = f" (see cosyserve {info_name} --help)" if info_name else ""
            raise InvalidRequestError(exc.format_message().replace("\n", " ") + hint) from None


def register(app: typer.Typer) -> None:
    """Add this module's commands to the root app."""
    app.command("synth", cls=_OneLineErrors)(synth)


def synth(
    output: Annotated[Path, typer.Option("--output", "-o", help="WAV file to write (24 kHz mono 16-bit).")],
    text: Annotated[str, typer.Argument(help="Text to speak (none for --mode vc).", show_default=False)] = "",
    model_dir: Annotated[
        Path | None,
        typer.Option(
            help="Model directory (default: $COSYSERVE_MODEL_DIR, else "
            "$XDG_CACHE_HOME/cosyserve/models/CosyVoice2-0.5B).",
            show_default=False,
        ),
    ] = None,
    prompt_wav: Annotated[Path | None, typer.Option(help="Prompt recording of the voice.")] = None,
    prompt_text: Annotated[str, typer.Option(help="Transcript of --prompt-wav (zero_shot).")] = "",
    speaker: Annotated[str | None, typer.Option(help="Built-in speaker of spk2info.pt (sft).")] = None,
    mode: Annotated[
        ModeName | None,
        typer.Option(help="Default: from the inputs (see docs/synth.md).", show_default=False),
    ] = None,
    instruct: Annotated[str, typer.Option(help="Instruction, e.g. a style or dialect (instruct2).")] = "",
    source_wav: Annotated[Path | None, typer.Option(help="Speech to convert into the voice (vc).")] = None,
    stream: Annotated[bool, typer.Option("--stream", help="Synthesise chunk by chunk.")] = False,
    first_hop: Annotated[
        int | None, typer.Option(min=1, help="Tokens in the first streaming chunk (--stream).")
    ] = None,
    seed: Annotated[
        int | None, typer.Option(min=0, help="Seed of all sampling (default: a random one, reported).")
    ] = None,
    speed: Annotated[float, typer.Option(help="Speaking rate, 0.5 to 2 (non-streaming only).")] = 1.0,
    min_tokens: Annotated[
        int | None, typer.Option(min=1, help="At least N speech tokens per sentence.")
    ] = None,
    max_tokens: Annotated[
        int | None, typer.Option(min=1, help="At most N speech tokens per sentence.")
    ] = None,
    tokens: Annotated[
        int | None, typer.Option(min=1, help="Exactly N speech tokens (N x 0.04 s) per sentence.")
    ] = None,
    profile: Annotated[Profile, profile_option()] = Profile.AUTO,
    dtype: Annotated[Dtype | None, dtype_option()] = None,
    quantize: Annotated[Quantization | None, quantize_option()] = None,
    flow_quantize: Annotated[FlowQuantization | None, flow_quantize_option()] = None,
    device: Annotated[str | None, device_option()] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
) -> None:
    """Synthesise TEXT into a WAV file and report the time spent in each stage."""
    given = {
        "TEXT": bool(text),
        "--prompt-wav": prompt_wav is not None,
        "--prompt-text": bool(prompt_text),
        "--speaker": speaker is not None,
        "--instruct": bool(instruct),
        "--source-wav": source_wav is not None,
    }
    chosen = mode or infer_mode(given)
    check_inputs(chosen, given)
    if tokens is not None:
        if min_tokens is not None or max_tokens is not None:
            raise InvalidRequestError(
                "--tokens replaces --min-tokens and --max-tokens; give one or the other"
            )
        min_tokens = max_tokens = tokens
    if chosen is ModeName.vc and (min_tokens is not None or max_tokens is not None):
        raise InvalidRequestError("mode vc takes its length from --source-wav; token counts do not apply")
    if first_hop is not None and not stream:
        raise InvalidRequestError("--first-hop needs --stream")
    _check_output(output)
    root = require_model_dir(model_dir or default_model_dir())
    job = Job(
        mode=chosen,
        text=text,
        prompt=AudioFile.read("--prompt-wav", prompt_wav) if prompt_wav else None,
        prompt_text=prompt_text,
        speaker=speaker,
        instruct=instruct,
        source=AudioFile.read("--source-wav", source_wav) if source_wav else None,
        stream=stream,
        seed=secrets.randbits(31) if seed is None else seed,  # drawn here so the report names it
        speed=speed,
        min_tokens=min_tokens,
        max_tokens=max_tokens,
        first_hop=first_hop,
        profile=profile,
        choices=Choices(dtype, quantize, flow_quantize, device),
    )
    report = run(root, job, output)
    if as_json:
        typer.echo(json.dumps(report.as_dict(), indent=2))
    else:
        for line in report.lines():
            typer.echo(line)


def infer_mode(given: dict[str, bool]) -> ModeName:
    """The mode the given inputs ask for, most specific input first."""
    if given["--source-wav"]:
        return ModeName.vc
    if given["--instruct"]:
        return ModeName.instruct2
    if given["--speaker"]:
        return ModeName.sft
    if given["--prompt-wav"]:
        return ModeName.zero_shot if given["--prompt-text"] else ModeName.cross_lingual
    raise InvalidRequestError(
        "no voice given: pass --prompt-wav F [--prompt-text T], --speaker NAME, "
        "or --prompt-wav F --source-wav S for voice conversion"
    )


def check_inputs(mode: ModeName, given: dict[str, bool]) -> None:
    """Raise :class:`InvalidRequestError` unless exactly the inputs ``mode`` reads are given."""
    wanted = MODE_INPUTS[mode]
    missing = sorted(name for name in wanted if not given[name])
    if missing:
        what = "text" if missing == ["TEXT"] else " and ".join(missing)
        raise InvalidRequestError(f"mode {mode.value} needs {what}")
    unused = sorted(name for name, present in given.items() if present and name not in wanted)
    if unused:
        what = "text" if unused == ["TEXT"] else ", ".join(unused)
        raise InvalidRequestError(f"mode {mode.value} does not use {what}")


def run(root: Path, job: Job, output: Path) -> SynthReport:
    """Load the model at ``root``, synthesise ``job`` into ``output`` and time it."""
    # Torch and the models load only once the command line is known to be usable.
    from cosyserve.pipeline.request import MAX_SPEED, MIN_SPEED
    from cosyserve.pipeline.synthesizer import Synthesizer

    # SynthesisRequest.validate() checks these as well, but only once there is a voice,
    # which for the full-size model is some 20 s of loading later.
    if not MIN_SPEED <= job.speed <= MAX_SPEED:
        raise InvalidRequestError(f"--speed must be between {MIN_SPEED} and {MAX_SPEED}")
    if job.speed != 1.0 and job.stream:
        raise InvalidRequestError("--speed is only supported without --stream")

    start = time.perf_counter()
    synth = Synthesizer.from_model_dir(root, profile=job.profile, choices=job.choices)
    model_load_s = time.perf_counter() - start
    max_len = synth.engine.config.max_len
    if job.max_tokens is not None and job.max_tokens > max_len:
        raise InvalidRequestError(f"{job.max_tokens} speech tokens do not fit the LM's {max_len} positions")

    before = synth.engine.stats.snapshot()
    start = time.perf_counter()
    request = _request(synth, job)
    prompt_features_s = time.perf_counter() - start
    request.validate()
    if job.mode is not ModeName.vc:
        # stream() normalises the text again; this first pass times the text frontend on
        # its own and rejects text that normalises to nothing before any model runs. The
        # second pass costs milliseconds (the grammars are loaded by then).
        synth.frontend.text_segments(job.text)
    frontend_s = time.perf_counter() - start

    chunks: list[np.ndarray] = []
    first_chunk_s = 0.0
    for chunk in synth.stream(request):
        if not chunks:
            first_chunk_s = time.perf_counter() - start
        chunks.append(chunk)
    wall_s = time.perf_counter() - start
    if not job.stream:
        first_chunk_s = wall_s  # a non-streaming caller gets all of the audio at once
    audio = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.float32)
    _write_wav(output, audio, synth.sample_rate)
    rate = synth.sample_rate
    return SynthReport(
        output=str(output),
        mode=job.mode.value,
        stream=job.stream,
        seed=job.seed,
        sample_rate=rate,
        audio_s=audio.shape[0] / rate,
        chunks=len(chunks),
        first_chunk_audio_s=chunks[0].shape[0] / rate if chunks else 0.0,
        wall_s=wall_s,
        first_chunk_s=first_chunk_s,
        model_load_s=model_load_s,
        prompt_features_s=prompt_features_s,
        text_frontend_s=frontend_s - prompt_features_s,
        engine=StageCounters.between(before, synth.engine.stats.snapshot()),
        peak_rss_mib=_peak_rss_mib(),
        precision=synth.model.precision.describe(),
        plan=synth.model.plan.describe(),
        kv_cache_dtype=str(synth.engine.lm_runner.cache.k.dtype).removeprefix("torch."),
    )


def _request(synth: "Synthesizer", job: Job) -> "SynthesisRequest":
    """The request of ``job``, with the prompt features computed (the timed prompt stage)."""
    from cosyserve.pipeline.request import Mode, SynthesisOptions, SynthesisRequest

    prompt, source = job.prompt, job.source
    if job.speaker is not None:
        voice = synth.speaker(job.speaker)
    elif prompt is not None:
        voice = prompt.decode(lambda data: synth.voice_from_audio(data, job.prompt_text))
    else:
        voice = None
    return SynthesisRequest(
        text=job.text,
        mode=Mode(job.mode.value),
        voice=voice,
        instruct=job.instruct,
        source_speech_tokens=source.decode(synth.frontend.source_tokens) if source else None,
        stream=job.stream,
        options=SynthesisOptions(
            seed=job.seed,
            speed=job.speed,
            min_tokens=job.min_tokens,
            max_tokens=job.max_tokens,
            first_hop=job.first_hop,
        ),
    )


def _check_output(path: Path) -> None:
    if path.is_dir():
        raise InvalidRequestError(f"--output {path} is a directory")
    if not path.parent.is_dir():
        raise InvalidRequestError(f"--output {path}: directory {path.parent} does not exist")


def _write_wav(path: Path, audio: np.ndarray, sample_rate: int) -> None:
    """16-bit PCM; samples beyond full scale are clipped (libsndfile would wrap them)."""
    try:
        sf.write(path, np.clip(audio, -1.0, 1.0), sample_rate, format="WAV", subtype="PCM_16")
    except (OSError, sf.SoundFileError) as exc:
        raise InvalidRequestError(f"cannot write --output {path}: {exc}") from None


def _peak_rss_mib() -> float:
    # Linux reports ru_maxrss in KiB.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
