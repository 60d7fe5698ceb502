"""What narrower stream caches (the plan's ``flow_cache_dtype``: ``int8`` in the ``fast``
plans whose flow computes in float32, or ``fp16``) change in a stream's audio, and the
memory they save, on a model directory of either family:

    OMP_NUM_THREADS=2 python benchmarks/stream_cache_dtype.py --model-dir DIR \\
        [--prompt 75] [--tokens 150] [--json out.json]

One streamed zero-shot request (a synthetic prompt of ``--prompt`` speech tokens,
``--tokens`` forced speech tokens) runs through the engine of this machine's ``fast`` plan
three times: its flow stream caches as computed (float32 on such a CPU), in float16, then
in int8. Prints the largest and mean difference of each narrower run's samples from the
first run's, its SNR against them, the most memory the stream's own flow caches held in
each run (not the voice's primed prompt, which its streams share) and each run's wall time.
"""

import json
import time

import numpy as np
from common import add_workload_args, model_dir_parser, wave_errors

from cosyserve.accel.flow_cache_mode import FLOW_CACHE_DTYPES, FlowCacheDtype
from cosyserve.accel.machine import Machine
from cosyserve.accel.plan import Profile, choose_plan
from cosyserve.bench.engine_runs import RequestResult, collect
from cosyserve.bench.workload import synthetic_spec, synthetic_text_ids, synthetic_voice
from cosyserve.engine.engine import Engine
from cosyserve.engine.loader import LoadedModel, engine_config_for, load_model
from cosyserve.engine.request import GenerationSpec


def main() -> None:
    parser = model_dir_parser(__doc__)
    add_workload_args(parser)
    args = parser.parse_args()
    model = load_model(args.model_dir, choose_plan(Machine.detect(), Profile.FAST))
    print(model.plan.describe(), flush=True)
    voice = synthetic_voice(model.hparams, args.prompt / model.hparams.flow.input_frame_rate, seed=0)
    text = synthetic_text_ids(model.hparams, args.tokens, seed=1)
    spec = synthetic_spec("s", voice, text, tokens=args.tokens, seed=2, stream=True)
    report: dict[str, dict[str, float]] = {}
    audio = {}
    for held in FLOW_CACHE_DTYPES:
        audio[held], report[held] = _run(model, spec, held)
        print(f"{held}: {report[held]}", flush=True)
    for held in FLOW_CACHE_DTYPES:
        if held != "computed":
            report[f"{held} against computed"] = wave_errors(audio["computed"], audio[held])
            print(f"{held} against computed: {report[f'{held} against computed']}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


def _run(
    model: LoadedModel, spec: GenerationSpec, cache_dtype: FlowCacheDtype
) -> tuple[np.ndarray, dict[str, float]]:
    """The request's samples, its wall seconds and the most its flow caches held (MiB)."""
    config = engine_config_for(model, flow_cache_dtype=cache_dtype)
    engine = Engine(model.lm, model.flow, model.hift, config)
    held = 0
    start = time.perf_counter()
    engine.add(spec)
    results: dict[str, RequestResult] = {}
    while engine.has_work():
        collect(engine.step(), results)
        held = max(held, _cache_bytes(engine))
    seconds = time.perf_counter() - start
    return results["s"].audio, {"seconds": round(seconds, 2), "cache_mib": round(held / 2**20, 1)}


def _cache_bytes(engine: Engine) -> int:
    """What the running streams' own flow caches hold (either family's)."""
    held = 0
    for request in engine.scheduler.running:
        for seg in request.segments:
            if seg.flow_cache is not None:
                held += seg.flow_cache.nbytes()
            if seg.flow3 is not None:
                held += sum(cache.nbytes() for cache in seg.flow3.caches)
    return held


if __name__ == "__main__":
    main()
