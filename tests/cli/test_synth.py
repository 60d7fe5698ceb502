"""``cosyserve synth`` on the tiny model: every mode, streaming, the report, bad input."""

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soundfile as sf
from typer.testing import CliRunner

from cosyserve.cli.main import app
from cosyserve.cli.synth import MODE_INPUTS, ModeName, check_inputs, infer_mode
from cosyserve.errors import InvalidRequestError
from cosyserve.pipeline.request import Mode

RATE = 24000
SAMPLES_PER_TOKEN = 960  # 25 tokens/s at 24 kHz
PROMPT_SECONDS = 0.8
PROMPT_TEXT = "希望你以后能够做的比我还好呦。"
STAGES = (
    "model_load_s",
    "frontend_s",
    "prompt_features_s",
    "text_frontend_s",
    "lm_prefill_s",
    "lm_decode_s",
    "flow_s",
    "hift_s",
    "other_s",
)


def _recording(path: Path, seconds: float, seed: int) -> Path:
    """A speech-like 24 kHz recording: gliding harmonics in syllable bursts, plus noise."""
    gen = np.random.default_rng(seed)
    t = np.arange(round(seconds * RATE)) / RATE
    phase = 2 * np.pi * np.cumsum(130 + 30 * np.sin(2 * np.pi * 1.3 * t)) / RATE
    voiced = sum(np.sin(k * phase) / k for k in range(1, 6))
    wav = 0.2 * (0.55 + 0.45 * np.sin(2 * np.pi * 4 * t)) * voiced + 0.01 * gen.standard_normal(t.size)
    sf.write(path, wav.astype(np.float32), RATE, subtype="PCM_16")
    return path


@pytest.fixture(scope="module")
def wavs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("synth_inputs")
    not_audio = root / "notes.wav"
    not_audio.write_text("this is not audio\n")
    empty = root / "empty.wav"
    empty.write_bytes(b"")
    return {
        "prompt": _recording(root / "prompt.wav", PROMPT_SECONDS, seed=1),
        "source": _recording(root / "source.wav", 0.8, seed=2),
        "not_audio": not_audio,
        "empty": empty,
        "dir": root,
    }


def _synth(model_dir: Path, *args: str, env: dict[str, str] | None = None) -> Any:
    return CliRunner().invoke(app, ["synth", "--model-dir", str(model_dir), *args], env=env)


def _json_run(model_dir: Path, *args: str) -> dict[str, Any]:
    result = _synth(model_dir, *args, "--json", "--seed", "3")
    assert result.exit_code == 0, result.output
    assert result.stderr == ""
    report: dict[str, Any] = json.loads(result.stdout)
    return report


def _read_wav(path: Path) -> np.ndarray:
    info = sf.info(str(path))
    assert (info.samplerate, info.channels, info.format, info.subtype) == (RATE, 1, "WAV", "PCM_16")
    audio, _ = sf.read(str(path), dtype="float32")
    assert np.isfinite(audio).all() and np.abs(audio).max() > 0
    return audio


# -- the command line, without a model -------------------------------------------------------


def test_cli_modes_are_the_pipeline_modes() -> None:
    assert {m.value for m in ModeName} == {m.value for m in Mode}
    assert set(MODE_INPUTS) == set(ModeName)


@pytest.mark.parametrize(
    ("inputs", "mode"),
    [
        ({"--prompt-wav", "--prompt-text"}, ModeName.zero_shot),
        ({"--prompt-wav"}, ModeName.cross_lingual),
        ({"--prompt-wav", "--instruct"}, ModeName.instruct2),
        ({"--speaker"}, ModeName.sft),
        ({"--prompt-wav", "--source-wav"}, ModeName.vc),
    ],
)
def test_mode_follows_from_the_inputs(inputs: set[str], mode: ModeName) -> None:
    given = {name: name in inputs for name in ("--prompt-wav", "--prompt-text", "--speaker")}
    given |= {name: name in inputs for name in ("--instruct", "--source-wav")}
    given["TEXT"] = mode is not ModeName.vc
    assert infer_mode(given) is mode
    check_inputs(mode, given)  # the inferred mode accepts exactly what led to it


def test_inputs_a_mode_would_ignore_are_refused() -> None:
    given = dict.fromkeys(("TEXT", "--prompt-wav", "--prompt-text", "--speaker"), True)
    given |= dict.fromkeys(("--instruct", "--source-wav"), False)
    with pytest.raises(InvalidRequestError, match="mode sft does not use --prompt-text, --prompt-wav"):
        check_inputs(ModeName.sft, given)


# -- synthesis on the tiny model ---------------------------------------------------------------


@pytest.mark.parametrize("mode", list(ModeName))
def test_every_mode_writes_a_24k_mono_wav(
    mode: ModeName, tiny_model_dir: Path, wavs: dict[str, Path], tmp_path: Path
) -> None:
    out = tmp_path / "out.wav"
    inputs = {
        ModeName.zero_shot: ["--prompt-wav", str(wavs["prompt"]), "--prompt-text", PROMPT_TEXT],
        ModeName.cross_lingual: ["--prompt-wav", str(wavs["prompt"])],
        ModeName.instruct2: ["--prompt-wav", str(wavs["prompt"]), "--instruct", "用开心的语气说"],
        ModeName.sft: ["--speaker", "中文女"],
        ModeName.vc: ["--prompt-wav", str(wavs["prompt"]), "--source-wav", str(wavs["source"])],
    }[mode]
    tokens = 7
    text_and_length = [] if mode is ModeName.vc else ["你好。", "--tokens", str(tokens)]
    report = _json_run(tiny_model_dir, *text_and_length, *inputs, "-o", str(out))

    audio = _read_wav(out)
    # vc: the source's tokens (0.8 s at 25 Hz) set the length.
    expected_tokens = 20 if mode is ModeName.vc else tokens
    assert audio.shape == (expected_tokens * SAMPLES_PER_TOKEN,)
    assert report["mode"] == mode.value and report["seed"] == 3 and report["stream"] is False
    assert report["audio_s"] == pytest.approx(expected_tokens * 0.04)
    assert report["first_chunk_s"] == report["wall_s"] > 0
    assert report["rtf"] == pytest.approx(report["wall_s"] / report["audio_s"])
    counters = report["counters"]
    if mode is ModeName.vc:
        assert counters["decode_steps"] == counters["prefill_positions"] == 0
    else:
        # The prefill samples the first token; each decode step one more.
        assert counters["decode_steps"] == tokens - 1
        assert counters["prefill_positions"] > 0
    assert counters["flow_calls"] == counters["hift_calls"] == 1


def test_stream_reports_every_stage(tiny_model_dir: Path, wavs: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "stream.wav"
    args = ["你好。", "--prompt-wav", str(wavs["prompt"]), "--prompt-text", PROMPT_TEXT, "--tokens", "40"]
    report = _json_run(tiny_model_dir, *args, "--stream", "--first-hop", "5", "-o", str(out))

    assert _read_wav(out).shape == (40 * SAMPLES_PER_TOKEN,)
    assert report["stream"] is True and report["chunks"] >= 2
    assert 0 < report["first_chunk_audio_s"] < report["audio_s"]
    assert 0 < report["first_chunk_s"] < report["wall_s"]
    stages = report["stages"]
    assert set(stages) == set(STAGES)
    assert all(stages[name] >= 0 for name in STAGES if name != "other_s")
    for stage in ("model_load_s", "prompt_features_s", "lm_prefill_s", "lm_decode_s", "flow_s", "hift_s"):
        assert stages[stage] > 0, stage
    measured = sum(stages[name] for name in STAGES if name not in ("model_load_s", "frontend_s"))
    assert measured == pytest.approx(report["wall_s"])
    assert stages["frontend_s"] == pytest.approx(stages["prompt_features_s"] + stages["text_frontend_s"])
    assert report["counters"]["flow_calls"] == report["chunks"]
    assert report["counters"]["decode_tokens_per_s"] == pytest.approx(39 / stages["lm_decode_s"])
    assert report["peak_rss_mib"] > 0


def test_human_report_names_each_stage(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "sft.wav"
    result = _synth(tiny_model_dir, "Hello.", "--speaker", "英文男", "--tokens", "5", "-o", str(out))
    assert result.exit_code == 0, result.output
    assert result.stderr == ""
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"wrote {out}: 0.20 s of audio at 24000 Hz (sft, non-stream, seed ")
    assert lines[1].startswith("wall ") and " RTF " in lines[1] and "first chunk" in lines[1]
    labels = [line.split()[0] for line in lines[2:-1]]
    assert labels == ["model", "plan", "frontend", "LM", "LM", "flow", "HiFT", "other"]
    assert lines[3].split(maxsplit=1)[1].startswith("profile auto (")  # no flags: the auto plan
    assert "(4 steps, " in lines[6] and "tok/s)" in lines[6]
    assert lines[-1].startswith("peak RSS ")
    assert _read_wav(out).shape == (5 * SAMPLES_PER_TOKEN,)


def test_console_script_uses_the_configured_model_dir(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "env.wav"
    env = {**os.environ, "COSYSERVE_MODEL_DIR": str(tiny_model_dir)}
    run_args = ["--tokens", "4", "--stream", "--json", "-o", str(out)]
    done = subprocess.run(
        [str(Path(sys.executable).parent / "cosyserve"), "synth", "Hi.", "--speaker", "中文女", *run_args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    report = json.loads(done.stdout)
    assert report["output"] == str(out) and report["stream"] is True
    assert _read_wav(out).shape == (4 * SAMPLES_PER_TOKEN,)


# -- bad input: one line, exit 2 ----------------------------------------------------------------

ERROR_CASES: list[tuple[str, list[str], str]] = [
    ("no text", ["--prompt-wav", "{prompt}"], "error: mode cross_lingual needs text"),
    ("blank text", ["   ", "--prompt-wav", "{prompt}"], "error: text is empty"),
    (
        "text normalises to nothing",
        ["。。。", "--speaker", "中文女"],
        "error: text is empty after normalization",
    ),
    ("unknown speaker", ["Hi.", "--speaker", "nobody"], "'nobody'"),
    ("no voice", ["Hi."], "error: no voice given"),
    (
        "zero_shot without transcript",
        ["Hi.", "--mode", "zero_shot", "--prompt-wav", "{prompt}"],
        "--prompt-text",
    ),
    (
        "instruct2 without instruction",
        ["Hi.", "--mode", "instruct2", "--prompt-wav", "{prompt}"],
        "--instruct",
    ),
    ("vc without source", ["--mode", "vc", "--prompt-wav", "{prompt}"], "mode vc needs --source-wav"),
    ("vc with text", ["Hi.", "--prompt-wav", "{prompt}", "--source-wav", "{source}"], "does not use text"),
    (
        "sft with prompt",
        ["Hi.", "--speaker", "中文女", "--prompt-wav", "{prompt}"],
        "does not use --prompt-wav",
    ),
    ("missing file", ["Hi.", "--prompt-wav", "{dir}/nope.wav"], "cannot read --prompt-wav"),
    ("directory as file", ["Hi.", "--prompt-wav", "{dir}"], "Is a directory"),
    ("empty file", ["Hi.", "--prompt-wav", "{empty}"], "is empty"),
    ("not audio", ["Hi.", "--prompt-wav", "{not_audio}"], "could not be decoded"),
    ("not audio (vc)", ["--prompt-wav", "{prompt}", "--source-wav", "{not_audio}"], "error: --source-wav"),
    ("seed not a number", ["Hi.", "--speaker", "中文女", "--seed", "abc"], "'--seed'"),
    ("speed not a number", ["Hi.", "--speaker", "中文女", "--speed", "fast"], "'--speed'"),
    ("speed out of range", ["Hi.", "--speaker", "中文女", "--speed", "5"], "between 0.5 and 2.0"),
    ("speed is nan", ["Hi.", "--speaker", "中文女", "--speed", "nan"], "between 0.5 and 2.0"),
    ("speed with stream", ["Hi.", "--speaker", "中文女", "--speed", "1.5", "--stream"], "without --stream"),
    ("zero tokens", ["Hi.", "--speaker", "中文女", "--tokens", "0"], "'--tokens'"),
    (
        "tokens and max",
        ["Hi.", "--speaker", "中文女", "--tokens", "3", "--max-tokens", "4"],
        "--tokens replaces",
    ),
    ("min above max", ["Hi.", "--speaker", "中文女", "--min-tokens", "5", "--max-tokens", "3"], "min_tokens"),
    ("too many tokens", ["Hi.", "--speaker", "中文女", "--tokens", "100000"], "do not fit"),
    ("tokens with vc", ["--prompt-wav", "{prompt}", "--source-wav", "{source}", "--tokens", "3"], "vc takes"),
    (
        "first hop without stream",
        ["Hi.", "--speaker", "中文女", "--first-hop", "5"],
        "--first-hop needs --stream",
    ),
    ("unknown mode", ["Hi.", "--speaker", "中文女", "--mode", "sing"], "'--mode'"),
    ("unknown option", ["Hi.", "--speaker", "中文女", "--loud"], "--loud"),
    (
        "output in a missing directory",
        ["Hi.", "--speaker", "中文女", "-o", "{dir}/no/out.wav"],
        "does not exist",
    ),
    ("output is a directory", ["Hi.", "--speaker", "中文女", "-o", "{dir}"], "is a directory"),
]


@pytest.mark.parametrize(("args", "expected"), [c[1:] for c in ERROR_CASES], ids=[c[0] for c in ERROR_CASES])
def test_bad_input_is_one_error_line_with_exit_2(
    args: list[str], expected: str, tiny_model_dir: Path, wavs: dict[str, Path], tmp_path: Path
) -> None:
    filled = [a.format(**{k: str(v) for k, v in wavs.items()}) for a in args]
    if "-o" not in filled:
        filled += ["-o", str(tmp_path / "out.wav")]
    result = _synth(tiny_model_dir, *filled)
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    assert expected in result.stderr
    assert not (tmp_path / "out.wav").exists()


def test_missing_output_option_is_one_line() -> None:
    result = CliRunner().invoke(app, ["synth", "Hi.", "--speaker", "中文女"])
    assert result.exit_code == 2
    assert result.stderr.startswith("error: Missing option '--output'") and result.stderr.count("\n") == 1


def test_missing_model_dir_says_how_to_make_one(tmp_path: Path) -> None:
    missing = tmp_path / "models" / "CosyVoice2-0.5B"
    out = str(tmp_path / "out.wav")
    result = CliRunner().invoke(
        app, ["synth", "Hi.", "--speaker", "x", "-o", out], env={"COSYSERVE_MODEL_DIR": str(missing)}
    )
    assert result.exit_code == 2
    assert result.stderr.count("\n") == 1
    assert f"error: model directory {missing} does not exist" in result.stderr
    assert "--model-dir" in result.stderr and "cosyserve model init DIR --size full" in result.stderr


@pytest.mark.parametrize(
    ("flags", "precision", "kv_cache_dtype"),
    [
        (["--dtype", "bf16"], "bf16/none on cpu (lm bfloat16, flow bfloat16, hift float32)", "bfloat16"),
        (["--quantize", "int8"], "fp32/int8 on cpu (lm float32, flow float32, hift float32)", "float32"),
        (
            ["--flow-quantize", "fp16"],
            "fp32/none on cpu (lm float32, flow float32 with fp16 weights, hift float32)",
            "float32",
        ),
    ],
)
def test_precision_flags(
    flags: list[str], precision: str, kv_cache_dtype: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out.wav"
    report = _json_run(
        tiny_model_dir,
        "Hello.",
        "--speaker",
        "英文男",
        "--tokens",
        "5",
        "-o",
        str(out),
        "--profile",
        "exact",
        *flags,
    )
    # kv_cache_dtype is read from the engine's cache tensors, not from the flags.
    assert (report["precision"], report["kv_cache_dtype"]) == (precision, kv_cache_dtype)
    assert report["plan"].startswith("profile exact (parity with upstream): ")
    assert _read_wav(out).shape == (5 * SAMPLES_PER_TOKEN,)


@pytest.mark.parametrize(
    ("flags", "message", "advice"),
    [
        (["--dtype", "fp16"], "error: fp16 needs a CUDA device", "on CPU use --dtype bf16 or fp32"),
        (
            ["--quantize", "int4"],
            "error: int4 quantization needs a CUDA device",
            "on CPU use --quantize int8",
        ),
        (["--dtype", "fp8"], "error: Invalid value for '--dtype'", "'fp32', 'bf16', 'fp16'"),
        (
            ["--dtype", "bf16", "--flow-quantize", "fp16"],
            "error: flow_quantize fp16 stores the float32 flow's weights, but the flow runs in bf16",
            "use --dtype fp32 or --flow-quantize none",
        ),
    ],
)
def test_precision_this_machine_cannot_run_is_one_line(
    flags: list[str], message: str, advice: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out.wav"
    result = _synth(tiny_model_dir, "Hello.", "--speaker", "英文男", "--tokens", "5", "-o", str(out), *flags)
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith(message) and result.stderr.count("\n") == 1, result.stderr
    assert advice in result.stderr
    assert not out.exists()
