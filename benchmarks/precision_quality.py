"""Quality cost and speed of each precision setting against float32, on one model directory.

    cosyserve model init /tmp/cv2-full --size full --seed 0      # once, 3.3 GB
    python benchmarks/precision_quality.py /tmp/cv2-full --out /tmp/precision.json
    python benchmarks/precision_quality.py /tmp/cv2-full --device cuda \
        --settings fp32,bf16,fp16,bf16+int8,bf16+int4 --out /tmp/precision-cuda.json

Each setting (``DTYPE[+QUANT][+flow-fp16][+compile]``, e.g. ``fp32``, ``bf16``,
``fp32+int8``, ``fp32+int8+flow-fp16``, ``bf16+compile``; ``flow-fp16`` is
``flow_quantize = fp16``) is loaded in a fresh process, so load time (with compilation and its
warm-up) and peak RSS are its own, and runs the same fixed inputs:

- LM, teacher-forced over ``--text`` random text ids + ``--prompt`` prompt speech tokens +
  ``--tokens`` speech tokens: top-1 agreement of the speech logits with float32 (the
  positions predicting a speech token), max/mean |logit error|, mean KL(fp32 || setting)
  of the sampling distributions; time of that forward pass.
- LM decode step time at batch 1 and 16 (``--context`` cached positions per sequence,
  KV cache in the setting's dtype), median and fastest of ``--steps`` steps.
- Flow, non-streaming, ``--tokens`` tokens after the ``--prompt``-token prompt: max/mean
  |mel error| and time.
- HiFT on the float32 flow's mel (the same input for every setting) with a fixed
  excitation: waveform max/mean |error| and SNR, and end to end on the setting's own mel.
  With ``bf16``, HiFT's convolutions are also run under CPU autocast (bf16) to show what
  bf16 would cost there (HiFT itself always loads in float32).

``--device cuda`` runs every setting, the float32 reference too, on the GPU (HiFT's
excitation is still drawn on the CPU, so it is the same in every setting); times then
include a device synchronisation.

Times of the LM forward, flow and HiFT are the fastest of ``--repeats`` runs. The
1-minute load average is recorded with every setting: on a shared machine compare times
only between rows of similar load, and prefer ``--threads 1`` there (with two threads and
a busy peer core, every small op waits at an OpenMP barrier for a descheduled thread,
which turns microsecond kernels into milliseconds). Results go to ``--out`` (JSON) and
stdout (markdown).
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
from common import wave_errors

from cosyserve.engine.loader import LoadedModel, load_model
from cosyserve.models.hift.generator import HiFTGenerator
from cosyserve.models.kv_cache import KVCache

DEFAULT_SETTINGS = "fp32,bf16,fp32+int8,fp32+int8wo,bf16+int8,fp32+flow-fp16"
FLOW_FP16 = "flow-fp16"
INPUT_SEED = 1234
_T = TypeVar("_T")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("model_dir", type=Path)
    parser.add_argument(
        "--settings", default=DEFAULT_SETTINGS, help=f"comma-separated (default {DEFAULT_SETTINGS})"
    )
    parser.add_argument("--text", type=int, default=30, help="text ids in the LM input")
    parser.add_argument("--prompt", type=int, default=75, help="prompt speech tokens (LM and flow)")
    parser.add_argument("--tokens", type=int, default=150, help="speech tokens to score / vocode")
    parser.add_argument("--context", type=int, default=32, help="cached positions per sequence when decoding")
    parser.add_argument("--steps", type=int, default=10, help="timed decode steps per batch size")
    parser.add_argument(
        "--repeats", type=int, default=1, help="runs of the LM forward, flow and HiFT (best kept)"
    )
    parser.add_argument(
        "--threads", type=int, default=0, help="torch threads per setting (default: torch's choice)"
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]: where every setting runs")
    parser.add_argument("--out", type=Path, default=None, help="write all results here as JSON")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--workdir", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        print(json.dumps(run_setting(args, args.worker, args.workdir)))
        return
    settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    if "fp32" in settings:
        settings.remove("fp32")
    settings.insert(0, "fp32")  # the reference runs first: later settings compare against it
    with tempfile.TemporaryDirectory(prefix="precision-") as tmp:
        results = [_spawn(args, setting, Path(tmp)) for setting in settings]
        for result in results:
            result.update(_compare(Path(tmp), result["setting"]))
    report = {"model_dir": str(args.model_dir), "args": _argv_summary(args), "results": results}
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2))
    print(_markdown(results))


def parse_setting(setting: str) -> tuple[str, str, bool, str]:
    """``bf16+int8`` -> ("bf16", "int8", False, "none"); ``fp32+compile`` -> ("fp32", "none",
    True, "none"); ``fp32+flow-fp16`` -> ("fp32", "none", False, "fp16")."""
    dtype, *extras = setting.split("+")
    compile_lm = "compile" in extras
    flow_quantize = "fp16" if FLOW_FP16 in extras else "none"
    quantize = [extra for extra in extras if extra not in ("compile", FLOW_FP16)]
    return dtype, quantize[0] if quantize else "none", compile_lm, flow_quantize


def _spawn(args: argparse.Namespace, setting: str, workdir: Path) -> dict[str, Any]:
    command = [sys.executable, __file__, str(args.model_dir), "--worker", setting, "--workdir", str(workdir)]
    for name in ("text", "prompt", "tokens", "context", "steps", "repeats", "threads", "device"):
        command += [f"--{name}", str(getattr(args, name))]
    print(f"# {setting}: load average {os.getloadavg()[0]:.2f}", file=sys.stderr, flush=True)
    done = subprocess.run(command, check=True, capture_output=True, text=True)
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def run_setting(args: argparse.Namespace, setting: str, workdir: Path) -> dict[str, Any]:
    """Load one setting, run the fixed inputs, save outputs under ``workdir``, return timings."""
    dtype, quantize, compile_lm, flow_quantize = parse_setting(setting)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    load_avg_before = os.getloadavg()[0]
    start = time.perf_counter()
    model = load_model(
        args.model_dir,
        dtype=dtype,
        quantize=quantize,
        compile=compile_lm,
        flow_quantize=flow_quantize,
        device=args.device,
    )
    load_s = time.perf_counter() - start
    load_peak_mb = _peak_rss_mb()
    load_anon_mb = _anon_rss_mb()
    inputs = {name: value.to(args.device) for name, value in _inputs(model, args).items()}
    out: dict[str, Any] = {"setting": setting, "precision": model.precision.describe(), "load_s": load_s}
    out["threads"] = torch.get_num_threads()
    out["load_peak_rss_mb"] = load_peak_mb
    out["load_anon_rss_mb"] = load_anon_mb

    with torch.inference_mode():
        logits, out["lm_forward_s"] = _timed(lambda: _teacher_forced(model, inputs), args.repeats)
        np.save(workdir / f"{setting}.logits.npy", logits)
        for batch in (1, 16):
            times = _decode_step_times(model, batch, args)
            out[f"decode_b{batch}_ms"] = 1000 * statistics.median(times)
            out[f"decode_b{batch}_min_ms"] = 1000 * min(times)
        mel, out["flow_s"] = _timed(lambda: _flow(model, inputs), args.repeats)
        np.save(workdir / f"{setting}.mel.npy", mel)
        ref_mel_path = workdir / "fp32.mel.npy"
        ref_mel = torch.from_numpy(np.load(ref_mel_path) if ref_mel_path.exists() else mel).to(args.device)
        wave, out["hift_s"] = _timed(lambda: _vocode(model.hift, ref_mel), args.repeats)
        np.save(workdir / f"{setting}.wave.npy", wave)
        np.save(
            workdir / f"{setting}.wave_e2e.npy", _vocode(model.hift, torch.from_numpy(mel).to(args.device))
        )
        if dtype == "bf16" and not model.precision.on_cuda:
            wave_bf16, out["hift_autocast_bf16_s"] = _timed(
                lambda: _vocode_autocast_bf16(model.hift, ref_mel), args.repeats
            )
            np.save(workdir / f"{setting}.wave_hift_bf16.npy", wave_bf16)
    out["peak_rss_mb"] = _peak_rss_mb()
    out["anon_rss_mb"] = _anon_rss_mb()
    out["load_avg_1m"] = [load_avg_before, os.getloadavg()[0]]
    return out


def _inputs(model: LoadedModel, args: argparse.Namespace) -> dict[str, torch.Tensor]:
    """Fixed random inputs: the same in every process for the same geometry."""
    gen = torch.Generator().manual_seed(INPUT_SEED)
    speech = model.hparams.lm.speech_token_size
    return {
        "text": torch.randint(0, model.hparams.lm.qwen.vocab_size, (args.text,), generator=gen),
        "prompt": torch.randint(0, speech, (args.prompt,), generator=gen),
        "tokens": torch.randint(0, speech, (args.tokens,), generator=gen),
        "prompt_mel": torch.randn(2 * args.prompt, 80, generator=gen) * 2.0 - 6.0,
        "embedding": torch.randn(192, generator=gen),
    }


def _teacher_forced(model: LoadedModel, inputs: dict[str, torch.Tensor]) -> np.ndarray:
    """Speech logits (float32) at every position that predicts a speech token: from the
    task-id position to the end, (prompt + tokens + 1, 6564)."""
    lm = model.lm
    prefix = lm.prompt_embeddings(inputs["text"], inputs["prompt"])
    full = torch.cat([prefix, lm.speech_embedding(inputs["tokens"])])
    _, logits = lm.teacher_forced(full[None])
    first = inputs["text"].shape[0] + 1  # sos + text, then the task id predicts the first token
    result: np.ndarray = logits[0, first:].float().cpu().numpy()
    return result


def _decode_step_times(model: LoadedModel, batch: int, args: argparse.Namespace) -> list[float]:
    lm = model.lm
    cfg = lm.cfg.qwen
    max_len = args.context + args.steps + 4
    device = model.precision.torch_device
    cache = KVCache.for_config(cfg, batch, max_len, model.precision.kv_cache_dtype, device)
    slots = [cache.allocate() for _ in range(batch)]
    gen = torch.Generator().manual_seed(INPUT_SEED)
    ids = torch.randint(0, lm.cfg.speech_token_size, (batch, args.context), generator=gen).to(device)
    step = cache.begin(slots, args.context)
    lm.qwen(lm.speech_embedding(ids), step)
    cache.commit(step)
    tokens = ids[:, -1]
    lm.decode(tokens, slots, cache)  # warm-up
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        lm.decode(tokens, slots, cache)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return times


def _flow(model: LoadedModel, inputs: dict[str, torch.Tensor]) -> np.ndarray:
    mel = model.flow.inference(
        inputs["tokens"][None],
        inputs["prompt"][None],
        inputs["prompt_mel"][None],
        inputs["embedding"][None],
        streaming=False,
        finalize=True,
    )
    result: np.ndarray = mel.float().cpu().numpy()
    return result


def _vocode(hift: HiFTGenerator, mel: torch.Tensor) -> np.ndarray:
    wave, _ = hift.inference(mel.float(), generator=torch.Generator().manual_seed(0))
    result: np.ndarray = wave.float().cpu().numpy()
    return result


def _vocode_autocast_bf16(hift: HiFTGenerator, mel: torch.Tensor) -> np.ndarray:
    """HiFT with its convolutions in bfloat16 (CPU autocast); STFT and iSTFT kept float32,
    which autocast does not do by itself. An experiment only: this patches the instance."""
    stft, istft = hift._stft, hift._istft
    hift._stft = lambda samples: stft(samples.float())  # type: ignore[method-assign]
    hift._istft = lambda magnitude, phase: istft(magnitude.float(), phase.float())  # type: ignore[method-assign]
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return _vocode(hift, mel)
    finally:
        del hift._stft, hift._istft


def _compare(workdir: Path, setting: str) -> dict[str, Any]:
    ref = {kind: np.load(workdir / f"fp32.{kind}.npy") for kind in ("logits", "mel", "wave", "wave_e2e")}
    logits = np.load(workdir / f"{setting}.logits.npy")
    mel = np.load(workdir / f"{setting}.mel.npy")
    out = {
        "lm_top1_agreement": float((logits.argmax(-1) == ref["logits"].argmax(-1)).mean()),
        "lm_logit_max_err": float(np.abs(logits - ref["logits"]).max()),
        "lm_logit_mean_err": float(np.abs(logits - ref["logits"]).mean()),
        "lm_logit_std_fp32": float(ref["logits"].std()),
        "lm_kl_mean": _mean_kl(ref["logits"], logits),
        "flow_mel_max_err": float(np.abs(mel - ref["mel"]).max()),
        "flow_mel_mean_err": float(np.abs(mel - ref["mel"]).mean()),
        "flow_mel_std_fp32": float(ref["mel"].std()),
    }
    for kind in ("wave", "wave_e2e"):
        wave = np.load(workdir / f"{setting}.{kind}.npy")
        out.update(_wave_errors(kind, ref["wave"] if kind == "wave" else ref["wave_e2e"], wave))
    bf16_hift = workdir / f"{setting}.wave_hift_bf16.npy"
    if bf16_hift.exists():
        out.update(_wave_errors("wave_hift_bf16", ref["wave"], np.load(bf16_hift)))
    return out


def _wave_errors(kind: str, ref: np.ndarray, wave: np.ndarray) -> dict[str, float]:
    return {f"{kind}_{name}": value for name, value in wave_errors(ref, wave).items()}


def _mean_kl(ref_logits: np.ndarray, logits: np.ndarray) -> float:
    """Mean over positions of KL(softmax(ref) || softmax(logits)), in nats."""
    ref_lp = torch.from_numpy(ref_logits).double().log_softmax(-1)
    lp = torch.from_numpy(logits).double().log_softmax(-1)
    return float((ref_lp.exp() * (ref_lp - lp)).sum(-1).mean())


def _timed(fn: Callable[[], _T], repeats: int = 1) -> tuple[_T, float]:
    """``fn()``'s value and its fastest wall time over ``repeats`` runs."""
    best = float("inf")
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        value = fn()
        best = min(best, time.perf_counter() - start)
    return value, best


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _anon_rss_mb() -> float:
    """Anonymous resident memory now (Linux): RSS without the clean, reclaimable pages of
    memory-mapped checkpoints. 0 where /proc is unavailable."""
    status = Path("/proc/self/status")
    if not status.exists():
        return 0.0
    for line in status.read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _argv_summary(args: argparse.Namespace) -> dict[str, Any]:
    return {k: v for k, v in vars(args).items() if k not in ("worker", "workdir", "out", "model_dir")}


def _markdown(results: list[dict[str, Any]]) -> str:
    header = (
        "| setting | load avg | top-1 agree | logit max/mean err | KL | mel max/mean err "
        "| HiFT wave SNR (same mel / e2e) | decode b1 / b16 ms, median (min) | LM fwd s | flow s | HiFT s "
        "| load s | peak RSS MB (anon at end) |"
    )
    rows = [header, "|" + "---|" * 13]
    for r in results:
        load = "/".join(f"{x:.1f}" for x in r["load_avg_1m"])
        rows.append(
            f"| {r['setting']} | {load} | {r['lm_top1_agreement']:.3f} | "
            f"{r['lm_logit_max_err']:.3f} / {r['lm_logit_mean_err']:.4f} | {r['lm_kl_mean']:.2e} | "
            f"{r['flow_mel_max_err']:.3f} / {r['flow_mel_mean_err']:.4f} | "
            f"{r['wave_snr_db']:.1f} / {r['wave_e2e_snr_db']:.1f} dB | "
            f"{r['decode_b1_ms']:.1f} ({r['decode_b1_min_ms']:.1f}) / "
            f"{r['decode_b16_ms']:.1f} ({r['decode_b16_min_ms']:.1f}) | {r['lm_forward_s']:.2f} | "
            f"{r['flow_s']:.2f} | {r['hift_s']:.2f} | {r['load_s']:.1f} | "
            f"{r['peak_rss_mb']:.0f} ({r['anon_rss_mb']:.0f}) |"
        )
    for r in results:
        if "wave_hift_bf16_snr_db" in r:
            rows.append(
                f"\n{r['setting']}: HiFT convolutions in bf16 (autocast): "
                f"SNR {r['wave_hift_bf16_snr_db']:.1f} dB, "
                f"max err {r['wave_hift_bf16_max_err']:.4f}, {r['hift_autocast_bf16_s']:.2f} s "
                f"(fp32 HiFT {r['hift_s']:.2f} s)"
            )
    return "\n".join(rows)


if __name__ == "__main__":
    main()
