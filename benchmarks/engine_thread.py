"""The same engine requests on three threads of one process: why only one thread may run
torch multi-threaded (see ``cosyserve.parallelism``).

    python benchmarks/engine_thread.py --model-dir /tmp/cv2-full-bench [--dtype bf16 --quantize int8]

The model loads on a thread of its own (as ``load_model`` always does). Then, one after
another, two non-streaming requests of ``--tokens`` forced tokens each:

1. ``engine``: on a new thread while the main thread has handed its torch threads over
   and runs torch single-threaded (the server's arrangement);
2. ``MainThread``: on the main thread itself, which now runs torch on all the threads,
   so it starts an OpenMP pool that lives as long as it does;
3. ``after-main``: on another new thread while that pool is still there.

Each line gives the wall time and the engine's seconds in decode (also per step), flow
and HiFT. With 2 CPUs, run 3 pays for the two pools (more OpenMP threads than CPUs makes
idle workers sleep instead of spin); runs 1 and 2 do not.
"""

import argparse
import threading
import time
from collections.abc import Callable
from pathlib import Path

from cosyserve.bench.workload import synthetic_spec, synthetic_text_ids, synthetic_voice
from cosyserve.engine.engine import Engine
from cosyserve.engine.loader import LoadedModel, engine_config_for, load_model
from cosyserve.parallelism import hand_over_threads, pin_torch_threads


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--tokens", type=int, default=60)
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--quantize", default="int8")
    args = parser.parse_args()
    threads = hand_over_threads()
    model = load_model(args.model_dir, dtype=args.dtype, quantize=args.quantize, threads=threads)
    two = _two_requests(model, args.tokens)
    print(f"torch threads of the engine: {threads}", flush=True)
    _on_thread("engine", lambda: (pin_torch_threads(threads), two()))
    pin_torch_threads(threads)
    two()
    _on_thread("after-main", lambda: (pin_torch_threads(threads), two()))


def _two_requests(model: LoadedModel, tokens: int) -> Callable[[], None]:
    """Two requests on a new engine, each printing a line; made on the calling thread."""
    voice = synthetic_voice(model.hparams, 3.0, seed=0, name="bench")
    text = synthetic_text_ids(model.hparams, tokens, seed=0)
    counter = iter(range(1_000_000))

    def request(engine: Engine) -> None:
        stats = engine.stats
        before = (stats.decode_s, stats.decode_steps, stats.flow_s, stats.hift_s)
        start = time.perf_counter()
        engine.add(synthetic_spec(f"r{next(counter)}", voice, text, tokens=tokens, seed=0, stream=False))
        while engine.has_work():
            engine.step()
        decode, steps, flow, hift = (
            now - then
            for now, then in zip(
                (stats.decode_s, stats.decode_steps, stats.flow_s, stats.hift_s), before, strict=True
            )
        )
        print(
            f"{threading.current_thread().name:>12}: wall {time.perf_counter() - start:6.2f} s, "
            f"decode {decode:5.2f} s ({1000 * decode / max(steps, 1):5.1f} ms/step), "
            f"flow {flow:5.2f} s, HiFT {hift:4.2f} s",
            flush=True,
        )

    def two() -> None:
        engine = Engine(model.lm, model.flow, model.hift, engine_config_for(model, max_active=1))
        request(engine)
        request(engine)

    return two


def _on_thread(name: str, fn: Callable[[], object]) -> None:
    thread = threading.Thread(target=fn, name=name)
    thread.start()
    thread.join()


if __name__ == "__main__":
    main()
