"""cosyserve's engine against upstream's whole model on the same model directory: its
``CosyVoice2Model`` for a CosyVoice 2 directory, its ``CosyVoice3Model`` for a CosyVoice 3
one (the family is the directory's, as ``cosyserve serve`` detects it).

One command per family (docs/performance.md has the full-size one and its results):

    .venv/bin/python benchmarks/upstream_engine.py --model-dir DIR [--tokens 150] [--streams 8]
        [--prompt-seconds 3] [--profile auto] [--json out.json]
    COSYVOICE3_UPSTREAM=/tmp/upstream COSYVOICE3_SITE=/tmp/upv3-site \\
        .venv/bin/python benchmarks/upstream_engine.py --model-dir DIR3 [the same options]

(CosyVoice 3's upstream is a checkout of FunAudioLLM/CosyVoice at ace7c47 and the folder of
its extra packages, which ``tests/upstream3.py`` reads from those two variables; without
them the script stops and names them, unless ``--sides ours``.)

Both sides get the same synthetic zero-shot prompt (``--prompt-seconds`` of random prompt
tokens, mel and embedding, and a transcript; for CosyVoice 3, our frontend's system prompt
ending in ``<|endofprompt|>`` ahead of the transcript, which upstream's LM asserts is
there), the same text ids and exactly ``--tokens`` speech tokens per request (upstream
forced as upstream-cpu-baseline.md describes: min_len = max_len = N with all its stop ids
masked: CosyVoice 2's three, CosyVoice 3's 200, 6561..6760). Each side runs in its own
subprocess, so its peak RSS is its own. The two processes take turns (``--interleave``, the default;
``benchmarks/common.py``): one loads while the other waits, then the single requests run
one at a time, upstream's first, ours next, and so on, then each side's bursts. On this VM
the speed moves by 5-10 % within minutes, and run 55 (sides one after the other) saw our
memory-bound decode 10 % slower than an hour before; in turns each pair of requests meets
the same machine. Each side measures, after a warm-up (one short non-streaming request and
one stream of ``--tokens`` tokens of the same voice; every request has a text of its own,
none repeated, since our LM's prefix cache would serve a repeated text's prefill; on our
side the stream primes the voice's flow prompt states, as the first stream of a registered
voice does in a server, and leaves memory of a stream's size that the process keeps and
reuses, as a server that has served a stream does: on this VM a page faulted in for the
first time costs up to 40 µs, and a process's first stream faults in about 1 GiB):

1. non-streaming: wall time of one request, or the median of ``--repeats`` requests one
   after another (each with a text of its own);
2. streaming: time to the first audio of one request (then the rest, to its end), or the
   medians of ``--repeats``;
3. ``--streams`` concurrent streams: audio seconds made per wall second (upstream: one
   thread per stream calling ``tts``, as its servers do; ours: one asyncio task per
   stream on one :class:`~cosyserve.engine.async_engine.AsyncEngine`), in ``--bursts``
   bursts one after another (default 1). The first burst is the process's first at that
   concurrency: on our side its flow caches are new memory, whose page faults cost this VM
   far more than the pages' writes (docs/performance.md, "Physical limits"); a later burst
   reuses the memory, as a server does from its second burst of that size on. Each burst
   is reported, and the ratios are taken for the first and for the last;
4. peak RSS of the whole process (loading included), after loading, of loading plus the
   single requests (1 and 2), and of the concurrent streams (3) alone.

Upstream is the test-only reference, built by ``benchmarks/upstream_models.py`` from the
directory's yaml, as upstream's ``CosyVoice2`` / ``CosyVoice3`` classes build it: for
CosyVoice 2 the PyPI ``cosyvoice-minicpmo`` (``tests/pipeline/upstream_model.py``, with the
stand-ins of ``tests/upstream.py``), for CosyVoice 3 the checkout (``tests/upstream3.py``).
It runs in fp32 on CPU with its own sampling (global RNG), so its tokens differ from ours;
only the amount of work is the same (upstream's CosyVoice 3 also drops each silent token
after five in a row, which random weights almost never draw: the report's ``audio_s`` shows
it). Our side runs ``--profile``'s plan for this machine (default ``auto``, what ``cosyserve
serve`` runs without flags); ``--dtype``, ``--quantize`` and ``--flow-quantize`` override one
choice each, and ``--first-hop`` the plan's first hop. Upstream stays fp32. The report ends
with the ratios against the targets.
"""

import argparse
import asyncio
import dataclasses
import itertools
import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # tests/ (the upstream stand-ins) is not an installed package
    sys.path.insert(0, str(REPO))

from common import Turns, take_turns  # noqa: E402
from upstream_models import build_upstream, upstream_unavailable  # noqa: E402

from cosyserve.accel.plan import Plan  # noqa: E402
from cosyserve.accel.precision_choices import Dtype, FlowQuantization, Profile, Quantization  # noqa: E402
from cosyserve.bench.engine_bench import peak_rss_mb, reset_peak_rss  # noqa: E402
from cosyserve.bench.workload import family_prompt, synthetic_text_ids, synthetic_voice  # noqa: E402
from cosyserve.errors import ModelDirError  # noqa: E402
from cosyserve.modeldir.layout import ModelDir  # noqa: E402
from cosyserve.pipeline.voice import VoicePrompt  # noqa: E402

WARM_UP_TOKENS = 10
SIDES = ("upstream", "ours")
# Issue 4: ours / upstream must be at most (or, for throughput, at least) these.
TARGETS = {
    "non_stream_s": ("<=", 1 / 4),
    "first_audio_s": ("<=", 1 / 15),
    "streams_audio_s_per_s": (">=", 5.0),
    "streams_audio_s_per_s_last": (">=", 5.0),
    "peak_rss_mb": ("<=", 1.0),
}


# -- the workload, shared by both sides ------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Texts:
    """One text per request, none used twice: our LM's prefix cache would otherwise serve a
    repeated text's prefill (upstream has none)."""

    warm_up: tuple[int, ...]
    non_stream: list[tuple[int, ...]]  # one per repeat
    stream: list[tuple[int, ...]]
    bursts: list[list[tuple[int, ...]]]  # per burst, one per stream


def workload(model_dir: Path, args: argparse.Namespace) -> tuple[VoicePrompt, Texts, int]:
    """The voice, the texts and the model's sample rate."""
    directory = ModelDir.open(model_dir)
    hp = directory.hparams()
    voice = family_prompt(directory, synthetic_voice(hp, args.prompt_seconds, seed=args.seed, name="bench"))
    singles = 1 + 2 * args.repeats  # the warm-up's, then the single requests' (as before repeats)
    count = singles + args.streams * args.bursts
    ids = [synthetic_text_ids(hp, args.tokens, seed=args.seed + i) for i in range(count)]
    bursts = [ids[singles + n * args.streams : singles + (n + 1) * args.streams] for n in range(args.bursts)]
    texts = Texts(ids[0], ids[1 : 1 + args.repeats], ids[1 + args.repeats : singles], bursts)
    return voice, texts, hp.sample_rate


@dataclasses.dataclass(frozen=True)
class Singles:
    """The single requests' seconds, one per repeat, in the order they ran."""

    non_stream_s: list[float]
    first_audio_s: list[float]
    stream_s: list[float]
    samples: int  # of a non-streaming request

    def median_run(self) -> int:
        """The index of the non-streaming run whose time is reported (the median; the lower
        of the two middle ones for an even count, so that it is a run that happened)."""
        return self.non_stream_s.index(statistics.median_low(self.non_stream_s))


Synthesize = Callable[[tuple[int, ...], bool], tuple[float, float, int]]


def _singles(side: str, synthesize: Synthesize, texts: Texts, turns: Turns) -> Singles:
    """The non-streaming requests, then the streaming ones (``synthesize(text, stream)``
    returns the seconds to the first audio and to the end, and the samples made), each in
    its turn."""
    non_stream: list[float] = []
    samples = 0
    for n, text in enumerate(texts.non_stream):
        turns.wait()
        _progress(f"{side}: non-streaming, {n + 1} of {len(texts.non_stream)}")
        _, seconds, samples = synthesize(text, False)
        non_stream.append(seconds)
    first_audio: list[float] = []
    whole: list[float] = []
    for n, text in enumerate(texts.stream):
        turns.wait()
        _progress(f"{side}: streaming, {n + 1} of {len(texts.stream)}")
        first, seconds, _ = synthesize(text, True)
        first_audio.append(first)
        whole.append(seconds)
    return Singles(non_stream, first_audio, whole, samples)


# -- upstream --------------------------------------------------------------------------------


def run_upstream(model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    from tests.pipeline.upstream_model import forced_length, full_mask_step

    turns = Turns(args.take_turns)
    turns.wait()
    voice, texts, rate = workload(model_dir, args)
    start = time.perf_counter()
    model = build_upstream(model_dir)
    load_s = time.perf_counter() - start
    llm = model.llm
    llm.llm.forward_one_step = full_mask_step(llm.llm)
    original = llm.inference_wrapper, llm.sampling_ids

    def force(tokens: int) -> None:
        llm.inference_wrapper, llm.sampling_ids = original
        llm.inference_wrapper, llm.sampling_ids = forced_length(llm, tokens)

    def inputs(text: tuple[int, ...], stream: bool) -> dict[str, Any]:
        speech = voice.speech_tokens.to(torch.int32)[None]
        return {
            "text": torch.tensor([text], dtype=torch.int32),
            "flow_embedding": voice.embedding[None],
            "llm_embedding": voice.embedding[None],
            "prompt_text": torch.tensor([voice.prompt_text_ids], dtype=torch.int32),
            "llm_prompt_speech_token": speech,
            "flow_prompt_speech_token": speech,
            "prompt_speech_feat": voice.mel[None],
            "stream": stream,
        }

    def synthesize(text: tuple[int, ...], stream: bool) -> tuple[float, float, int]:
        """(seconds to the first audio, seconds to the end, samples)."""
        model.token_hop_len = 25  # upstream never resets it between calls (baseline, item 3)
        begin = time.perf_counter()
        first: float | None = None
        samples = 0
        for out in model.tts(**inputs(text, stream)):
            first = first if first is not None else time.perf_counter() - begin
            samples += int(out["tts_speech"].shape[-1])
        total = time.perf_counter() - begin
        return first if first is not None else total, total, samples

    if args.warm_up:
        force(WARM_UP_TOKENS)
        synthesize(texts.warm_up, stream=False)
        force(args.tokens)
        synthesize(texts.warm_up, stream=True)
    force(args.tokens)
    peaks = _loaded()
    singles = _singles("upstream", synthesize, texts, turns)
    single_peak = _phase_peak()

    def streams(burst: int) -> tuple[float, int]:
        results: list[tuple[float, float, int]] = []

        def worker(text: tuple[int, ...]) -> None:
            results.append(synthesize(text, stream=True))

        threads = [threading.Thread(target=worker, args=(t,)) for t in texts.bursts[burst]]
        begin = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return time.perf_counter() - begin, sum(r[2] for r in results)

    label = f"{args.streams} streams on {args.streams} threads"
    turns.wait()
    bursts = _bursts("upstream", label, streams, args.bursts, rate)
    return _side_report(load_s, singles, rate, bursts, peaks, single_peak)


# -- ours ------------------------------------------------------------------------------------


def _plan(args: argparse.Namespace, threads: int | None) -> Plan:
    from cosyserve.accel.machine import Machine
    from cosyserve.accel.plan import Choices, choose_plan

    choices = Choices(args.dtype, args.quantize, args.flow_quantize)
    plan = choose_plan(Machine.detect(), args.profile, choices, threads)
    return plan if args.first_hop is None else dataclasses.replace(plan, first_hop=args.first_hop)


def run_ours(model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    from cosyserve.bench.workload import synthetic_spec
    from cosyserve.engine.async_engine import AsyncEngine
    from cosyserve.engine.engine import Engine
    from cosyserve.engine.loader import engine_config_for, load_model
    from cosyserve.parallelism import hand_over_threads

    turns = Turns(args.take_turns)
    turns.wait()
    threads = hand_over_threads()  # as the server's event loop: model work on the engine's thread only
    voice, texts, rate = workload(model_dir, args)
    start = time.perf_counter()
    model = load_model(model_dir, _plan(args, threads))
    load_s = time.perf_counter() - start
    print(f"ours: plan: {model.plan.describe()}", file=sys.stderr, flush=True)
    config = engine_config_for(model, max_active=max(8, args.streams), max_waiting=args.streams)
    engine = AsyncEngine(Engine(model.lm, model.flow, model.hift, config), threads=threads)
    engine.start()
    counter = iter(range(1_000_000))

    async def synthesize(text: tuple[int, ...], stream: bool, tokens: int) -> tuple[float, float, int]:
        spec = synthetic_spec(
            f"r{next(counter)}", voice, text, tokens=tokens, seed=args.seed, stream=stream,
            first_hop=None,  # the plan's (a non-streaming request has none)
        )  # fmt: skip
        begin = time.perf_counter()
        first: float | None = None
        samples = 0
        async for chunk in engine.generate(spec):
            if first is None and chunk.audio.size:
                first = time.perf_counter() - begin
            samples += int(chunk.audio.size)
        total = time.perf_counter() - begin
        return first if first is not None else total, total, samples

    async def streams(burst: int) -> tuple[float, int]:
        begin = time.perf_counter()
        results = await asyncio.gather(*(synthesize(t, True, args.tokens) for t in texts.bursts[burst]))
        return time.perf_counter() - begin, sum(r[2] for r in results)

    try:
        if args.warm_up:  # the streaming one also primes the voice's flow prompt states
            asyncio.run(synthesize(texts.warm_up, False, WARM_UP_TOKENS))
            asyncio.run(synthesize(texts.warm_up, True, args.tokens))
        peaks = _loaded()
        non_stream_engine: list[dict[str, float]] = []

        def single(text: tuple[int, ...], stream: bool) -> tuple[float, float, int]:
            before = engine.engine.stats.snapshot()
            result = asyncio.run(synthesize(text, stream, args.tokens))
            if not stream:
                non_stream_engine.append(_spent(before, engine.engine.stats.snapshot()))
            return result

        singles = _singles("ours", single, texts, turns)
        single_peak = _phase_peak()
        snapshots = [engine.engine.stats.snapshot()]

        def burst(n: int) -> tuple[float, int]:
            done = asyncio.run(streams(n))
            snapshots.append(engine.engine.stats.snapshot())
            return done

        turns.wait()
        bursts = _bursts("ours", f"{args.streams} concurrent streams", burst, args.bursts, rate)
    finally:
        engine.shutdown()
    report = _side_report(load_s, singles, rate, bursts, peaks, single_peak)
    precision = {
        "plan": model.plan.describe(),  # the family's own, as loaded
        "precision": model.precision.describe(),
        "kv_cache_dtype": str(config.dtype).removeprefix("torch."),
    }
    # This process's main thread runs torch on one thread; the engine's runs on ``threads``.
    report |= {"flow_cache": config.flow_cache, "flow_stream_cache_mb": config.flow_stream_cache_mb}
    report |= {
        "flow_prompt_whole": config.flow_prompt_whole,
        "flow_cache_compact": config.flow_cache_compact,
        "flow_stream_rows": config.flow_stream_rows,
        "traced_decode": config.traced_decode,
        "traced_flow": config.traced_flow,
    }
    report |= {"flow_cache_refusals": engine.engine.stats.flow_cache_refusals, "torch_threads": threads}
    # Where each request's and burst's time went: engine seconds per stage and batch sizes.
    intervals = itertools.pairwise(snapshots)
    for burst_report, (before, after) in zip(report["streams_bursts"], intervals, strict=True):
        burst_report["engine"] = _spent(before, after)
    report["streams_engine"] = report["streams_bursts"][0]["engine"]
    report["non_stream_engine"] = non_stream_engine[singles.median_run()]
    report["non_stream_engine_runs"] = non_stream_engine
    return report | precision


_ENGINE_STAGES = (
    "prefill_s",
    "decode_s",
    "flow_s",
    "hift_s",
    "decode_steps",
    "flow_calls",
    "flow_rows",
    "hift_calls",
    "hift_rows",
)


def _spent(before: Any, after: Any) -> dict[str, float]:
    """The engine's work between two :class:`EngineStats` snapshots, by stage."""
    return {key: getattr(after, key) - getattr(before, key) for key in _ENGINE_STAGES}


# -- the two processes and the report --------------------------------------------------------


def _loaded() -> tuple[float, bool]:
    """After loading and warming up: the peak RSS so far, and whether the kernel's peak
    mark could be reset to measure the peak from here on."""
    return peak_rss_mb(), reset_peak_rss()


def _phase_peak() -> float:
    """The peak RSS since the last reset (the single requests after loading), then reset,
    so that the concurrent streams' peak is measured on its own."""
    peak = peak_rss_mb()
    reset_peak_rss()
    return peak


def _bursts(
    side: str, label: str, run: Callable[[int], tuple[float, int]], count: int, rate: int
) -> list[dict[str, Any]]:
    """``count`` bursts of concurrent streams, one after another (``run(n)`` runs burst ``n``,
    from 0, and returns its wall seconds and samples made): each one's wall seconds, audio
    seconds per second, and page faults that found no page (a new page each) and CPU
    seconds the kernel spent for the process (docs/performance.md, "Physical limits")."""
    out: list[dict[str, Any]] = []
    for n in range(count):
        _progress(f"{side}: {label}, burst {n + 1} of {count}")
        before = _kernel_usage()
        wall, samples = run(n)
        faults, kernel_s = (now - then for now, then in zip(_kernel_usage(), before, strict=True))
        out.append(
            {
                "wall_s": wall,
                "audio_s_per_s": samples / rate / wall,
                "page_faults": faults,
                "kernel_s": kernel_s,
            }
        )
    return out


def _side_report(
    load_s: float,
    singles: Singles,
    rate: int,
    bursts: list[dict[str, Any]],
    peaks: tuple[float, bool],
    single_peak: float,
) -> dict[str, Any]:
    load_peak, reset = peaks
    first, last = bursts[0], bursts[-1]
    streams_peak = peak_rss_mb()  # since the reset, or since the start if there was none
    after_load = max(single_peak, streams_peak)
    return {
        "load_s": load_s,
        "non_stream_s": singles.non_stream_s[singles.median_run()],
        "audio_s": singles.samples / rate,
        "first_audio_s": statistics.median(singles.first_audio_s),
        "stream_total_s": statistics.median(singles.stream_s),
        "non_stream_runs_s": singles.non_stream_s,
        "first_audio_runs_s": singles.first_audio_s,
        "stream_total_runs_s": singles.stream_s,
        # The first burst under the names of the runs before bursts, then the last.
        "streams_wall_s": first["wall_s"],
        "streams_audio_s_per_s": first["audio_s_per_s"],
        "streams_audio_s_per_s_last": last["audio_s_per_s"],
        "peak_rss_mb": max(load_peak, after_load),
        "peak_rss_after_load_mb": after_load if reset else None,
        "peak_rss_single_mb": max(load_peak, single_peak),
        "peak_rss_streams_mb": streams_peak if reset else None,
        "streams_page_faults": first["page_faults"],
        "streams_kernel_s": first["kernel_s"],
        "streams_page_faults_last": last["page_faults"],
        "streams_kernel_s_last": last["kernel_s"],
        "streams_bursts": bursts,
        "load_average_after": os.getloadavg(),
        "torch_threads": torch.get_num_threads(),
    }


def _kernel_usage() -> tuple[int, float]:
    """The process's minor page faults and kernel CPU seconds so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_minflt, usage.ru_stime


def _progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _worker(args: argparse.Namespace) -> None:
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    run = run_upstream if args.worker == "upstream" else run_ours
    print(json.dumps(run(args.model_dir, args)))


def _steps(args: argparse.Namespace) -> int:
    """How often a worker waits for its turn: before loading, before each single request and
    before its bursts."""
    return 2 + 2 * int(args.repeats)


def _run_interleaved(sides: list[str], args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Both sides' workers alive at once, taking turns (``benchmarks/common.py``): each one's
    loading and warm-up, then each single request, side after side; then each one's
    bursts."""
    load_before = os.getloadavg()
    commands = {side: [*_command(side, args), "--take-turns"] for side in sides}
    lines = take_turns(commands, _steps(args))
    return {side: _report(line, load_before) for side, line in lines.items()}


def _run_apart(sides: list[str], args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Each side's worker after the other's (``--no-interleave``), each after
    ``--settle-s`` of idle."""
    reports = {}
    for side in sides:
        if args.settle_s > 0:
            _progress(f"{args.settle_s:g} s idle before {side}")
            time.sleep(args.settle_s)
        load_before = os.getloadavg()
        done = subprocess.run(_command(side, args), check=True, stdout=subprocess.PIPE, text=True)
        reports[side] = _report(done.stdout.strip().splitlines()[-1], load_before)
    return reports


def _ours_plan(reports: dict[str, dict[str, Any]], args: argparse.Namespace) -> str:
    """The plan our side ran: as it loaded the model (a family narrows it), else as chosen."""
    ours = reports.get("ours", {})
    return str(ours["plan"]) if "plan" in ours else _plan(args, args.threads).describe()


def _report(line: str, load_before: tuple[float, float, float]) -> dict[str, Any]:
    """A worker's JSON report line, with the load average before its side ran."""
    report: dict[str, Any] = json.loads(line)
    report["load_average_before"] = load_before
    return report


def _command(side: str, args: argparse.Namespace) -> list[str]:
    """The worker command line of ``side``."""
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", side]
    command += [
        "--model-dir",
        str(args.model_dir),
        "--tokens",
        str(args.tokens),
        "--streams",
        str(args.streams),
        "--bursts",
        str(args.bursts),
        "--repeats",
        str(args.repeats),
    ]
    command += ["--prompt-seconds", str(args.prompt_seconds), "--seed", str(args.seed)]
    if args.threads is not None:
        command += ["--threads", str(args.threads)]
    command += ["--profile", args.profile]
    for flag in ("first_hop", "dtype", "quantize", "flow_quantize"):
        if getattr(args, flag) is not None:
            command += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    if not args.warm_up:
        command.append("--no-warm-up")
    return command


def _ratios(reports: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out = {}
    for key, (relation, target) in TARGETS.items():
        ratio = reports["ours"][key] / reports["upstream"][key]
        met = ratio <= target if relation == "<=" else ratio >= target
        out[key] = {"ratio": ratio, "target": f"{relation} {target:.4g}", "met": met}
    return out


# The single requests' times, one per repeat (the table has their medians).
_RUNS = ("non_stream_runs_s", "first_audio_runs_s", "stream_total_runs_s")


def _table(reports: dict[str, dict[str, Any]], ratios: dict[str, dict[str, Any]] | None) -> str:
    rows = [
        ("non-streaming wall (s)", "non_stream_s", "{:.2f}"),
        ("streaming: first audio (s)", "first_audio_s", "{:.2f}"),
        ("streaming: whole request (s)", "stream_total_s", "{:.2f}"),
        ("concurrent streams, first burst: audio s/s", "streams_audio_s_per_s", "{:.3f}"),
        ("concurrent streams, last burst: audio s/s", "streams_audio_s_per_s_last", "{:.3f}"),
        ("peak RSS, whole process (MiB)", "peak_rss_mb", "{:.0f}"),
        ("peak RSS after load (MiB)", "peak_rss_after_load_mb", "{:.0f}"),
        ("peak RSS, load + single requests (MiB)", "peak_rss_single_mb", "{:.0f}"),
        ("peak RSS, concurrent streams (MiB)", "peak_rss_streams_mb", "{:.0f}"),
        ("first burst: page faults", "streams_page_faults", "{:,}"),
        ("first burst: kernel CPU (s)", "streams_kernel_s", "{:.1f}"),
        ("last burst: page faults", "streams_page_faults_last", "{:,}"),
        ("last burst: kernel CPU (s)", "streams_kernel_s_last", "{:.1f}"),
        ("model load (s)", "load_s", "{:.1f}"),
    ]
    sides = [s for s in SIDES if s in reports]
    lines = ["| measure | " + " | ".join(sides) + (" | ours / upstream | target | met |" if ratios else " |")]
    lines.append("|---|" + "---:|" * len(sides) + ("---:|---|---|" if ratios else ""))
    for label, key, fmt in rows:
        cells = [fmt.format(reports[s][key]) if reports[s].get(key) is not None else "n/a" for s in sides]
        line = f"| {label} | " + " | ".join(cells) + " |"
        if ratios:
            r = ratios.get(key)
            line += f" {r['ratio']:.3f} | {r['target']} | {'yes' if r['met'] else 'NO'} |" if r else " | | |"
        lines.append(line)
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--tokens", type=int, default=150, help="speech tokens forced per request")
    parser.add_argument("--streams", type=int, default=8, help="concurrent streams")
    parser.add_argument("--bursts", type=int, default=1, help="bursts of --streams, one after another")
    parser.add_argument(
        "--repeats", type=int, default=1, help="single requests of each kind; their medians are reported"
    )
    parser.add_argument("--prompt-seconds", type=float, default=3.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument(
        "--profile",
        choices=[p.value for p in Profile],
        default=Profile.AUTO.value,
        help="ours only: the plan's profile (default auto: what the server runs without flags)",
    )
    parser.add_argument("--first-hop", type=int, default=None, help="ours only (default: the plan's)")
    parser.add_argument("--dtype", choices=[d.value for d in Dtype], help="ours only (default: the plan's)")
    parser.add_argument(
        "--quantize", choices=[q.value for q in Quantization], help="ours only (default: the plan's)"
    )
    parser.add_argument(
        "--flow-quantize", choices=[q.value for q in FlowQuantization], help="ours only (default: the plan's)"
    )
    parser.add_argument("--no-warm-up", dest="warm_up", action="store_false")
    parser.add_argument("--sides", default="upstream,ours", help="comma-separated: upstream, ours")
    parser.add_argument(
        "--settle-s",
        type=float,
        default=0.0,
        help="seconds of idle before each side, for a side that should start on a machine that "
        "has idled (tried on a 2-core VM: it did not change our side's numbers)",
    )
    parser.add_argument("--json", type=Path, default=None, help="write the reports and ratios here")
    parser.add_argument(
        "--interleave",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="both sides' processes alive at once, each single request in turn, side after side "
        "(default: a machine whose speed drifts slows both alike); --no-interleave runs one side's "
        "process after the other's",
    )
    parser.add_argument("--worker", choices=SIDES, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--take-turns", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        _worker(args)
        return
    if args.bursts < 1 or args.repeats < 1:
        parser.error("--bursts and --repeats must be at least 1")
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    if not sides or any(s not in SIDES for s in sides):
        parser.error(f"--sides takes {', '.join(SIDES)}")
    try:
        family = ModelDir.open(args.model_dir).family
    except ModelDirError as exc:
        parser.error(str(exc))
    unavailable = upstream_unavailable(family) if "upstream" in sides else None
    if unavailable is not None:
        parser.error(f"--model-dir {args.model_dir} is {unavailable}")
    uptime = Path("/proc/loadavg").read_text().strip() if Path("/proc/loadavg").exists() else "n/a"
    _progress(f"load average before: {uptime}")
    if args.interleave and args.settle_s > 0:
        parser.error("--settle-s idles before each side's process: it needs --no-interleave")
    reports = _run_interleaved(sides, args) if args.interleave else _run_apart(sides, args)
    ratios = _ratios(reports) if len(reports) == 2 else None
    print(
        f"{family.official_name} layout; "
        f"{args.tokens} tokens ({args.tokens / 25:.2f} s of audio) per request, {args.streams} streams, "
        f"{args.prompt_seconds:g} s prompt; ours: {_ours_plan(reports, args)}; upstream fp32; "
        f"/proc/loadavg before: {uptime}"
    )
    print(_table(reports, ratios), end="")
    for side, report in reports.items():
        runs = (f"{key} " + ", ".join(f"{t:.2f}" for t in report[key]) for key in _RUNS)
        print(f"{side}, each run (s): " + "; ".join(runs))
    if args.json is not None:
        settings = vars(args) | {"model_dir": str(args.model_dir), "json": str(args.json)}
        summary = {
            "args": settings,
            "family": family.value,
            "loadavg_before": uptime,
            "reports": reports,
            "ratios": ratios,
        }
        args.json.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
