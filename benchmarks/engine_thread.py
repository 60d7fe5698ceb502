"""The same engine requests on different threads of one process.

    python benchmarks/engine_thread.py --model-dir /tmp/cv2-full-bench [--dtype bf16 --quantize int8]

``AsyncEngine`` drives ``Engine.step()`` from its own thread, not the one that loaded the
model (here the main thread). This runs, one after another, two non-streaming requests of
``--tokens`` forced tokens on a first thread (which then exits), two on the main thread,
and two on another thread, and prints each one's wall time and engine seconds in decode
(also per step), flow and HiFT. Set ``OMP_WAIT_POLICY`` (ACTIVE or PASSIVE) in the
environment to see how OpenMP's idle threads take part.
"""

import argparse
import threading
import time
from pathlib import Path

from cosyserve.bench.workload import synthetic_spec, synthetic_text_ids, synthetic_voice
from cosyserve.engine.engine import Engine
from cosyserve.loader import engine_config_for, load_model


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--tokens", type=int, default=60)
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--quantize", default="int8")
    args = parser.parse_args()
    model = load_model(args.model_dir, dtype=args.dtype, quantize=args.quantize)
    engine = Engine(model.lm, model.flow, model.hift, engine_config_for(model, max_active=1))
    voice = synthetic_voice(model.hparams, 3.0, seed=0, name="bench")
    text = synthetic_text_ids(model.hparams, args.tokens, seed=0)
    counter = iter(range(1_000_000))

    def request(tokens: int) -> None:
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
            f"decode {decode:5.2f} s "
            f"({1000 * decode / max(steps, 1):5.1f} ms/step), flow {flow:5.2f} s, HiFT {hift:4.2f} s",
            flush=True,
        )

    def two_on(name: str) -> None:
        thread = threading.Thread(target=lambda: (request(args.tokens), request(args.tokens)), name=name)
        thread.start()
        thread.join()

    two_on("first")
    request(args.tokens)
    request(args.tokens)
    two_on("after-main")


if __name__ == "__main__":
    main()
