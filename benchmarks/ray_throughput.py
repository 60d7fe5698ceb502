"""Throughput of the Ray Serve application with 1 and 2 replicas on this machine.

    python benchmarks/ray_throughput.py --model-dir /tmp/cv2-full [--concurrency 4]
        [--requests 16] [--tokens 50] [--json out.json] [KEY=VALUE ... for build_app]

It starts a private one-node Ray cluster with as many CPUs as this machine has and Serve's
HTTP proxy on a free port, then deploys ``cosyserve.deploy.ray:build_app`` three ways,
one after the other:

- ``1 replica x 1 CPU``: one replica, 1 CPU and 1 torch thread (what one replica's share
  of a machine gives);
- ``2 replicas x 1 CPU``: two replicas, 1 CPU and 1 torch thread each;
- ``1 replica x 2 CPUs``: one replica with 2 CPUs and 2 torch threads (the whole of a
  2-core machine in one engine).

Each is warmed up (one round of ``concurrency`` requests, not counted), then gets
``--requests`` requests from ``--concurrency`` clients in a closed loop (each sends its next
request when its last one ends): OpenAI speech, non-streaming PCM, a built-in voice and
``--tokens`` forced speech tokens each (the same audio length every time). It reports
audio seconds made per wall second, requests per second and the latency percentiles
(``cosyserve bench server``'s measures), and which replicas answered. Everything it
started is stopped at the end, also after a failure.
"""

import argparse
import json
import os
import shutil
import socket
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import httpx
import ray
from common import model_dir_parser  # benchmarks/, the script's own directory
from ray import serve

from cosyserve.accel.machine import Machine
from cosyserve.bench.server_load import LevelReport, LoadOptions, run_server_load
from cosyserve.deploy.ray import DEPLOYMENT_NAME, build_app
from cosyserve.deploy.replica_header import REPLICA_HEADER

APP = "bench"
VOICE = "中文女"
# (label, replicas, CPUs and torch threads per replica)
LAYOUTS = (("1 replica x 1 CPU", 1, 1), ("2 replicas x 1 CPU", 2, 1), ("1 replica x 2 CPUs", 1, 2))


def main() -> None:
    parser = model_dir_parser(__doc__)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument(
        "--tokens", type=int, default=50, help="forced speech tokens per request (25 a second)"
    )
    parser.add_argument("args", nargs="*", help="more build_app arguments, KEY=VALUE (e.g. profile=exact)")
    options = parser.parse_args()
    extra = dict(arg.split("=", 1) for arg in options.args)
    cpus = os.cpu_count() or 1
    print(f"command: python {' '.join(sys.argv)}", flush=True)
    print(f"machine: {Machine.detect().describe()}; /proc/loadavg {loadavg()}", flush=True)
    # Ray's files, sockets and logs in a directory of this run's own, removed at the end.
    temp = tempfile.mkdtemp(prefix="ray-")
    os.environ["RAY_TMPDIR"] = temp
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    extra.setdefault("voices_db", str(Path(temp) / "voices.sqlite3"))
    ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False)
    results = []
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        url = f"http://127.0.0.1:{port}"
        for label, replicas, per_replica in LAYOUTS:
            if replicas * per_replica > cpus:
                print(f"{label}: skipped, needs {replicas * per_replica} CPUs", flush=True)
                continue
            args = {
                "model_dir": str(options.model_dir),
                "auth_mode": "none",
                "num_replicas": str(replicas),
                "num_cpus": str(per_replica),
                "threads": str(per_replica),
                **extra,
            }
            results.append(measure(label, url, args, options))
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            shutil.rmtree(temp, ignore_errors=True)
    print(f"/proc/loadavg at the end {loadavg()}")
    if options.json is not None:
        options.json.write_text(json.dumps(results, indent=2) + "\n")


def measure(label: str, url: str, args: dict[str, str], options: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    serve.run(build_app(args), name=APP, route_prefix="/")  # returns once every replica runs
    print(f"  replicas: {replica_states()}", flush=True)
    start_s = time.perf_counter() - started
    load = LoadOptions(
        url,
        concurrency=(options.concurrency,),
        requests=options.requests,
        format="pcm",
        voice=VOICE,
        tokens=options.tokens,
    )
    try:
        run_server_load(replace(load, requests=options.concurrency))  # warm-up, not counted
        replicas = answering_replicas(url, options.tokens)
        (level,) = run_server_load(load).levels
    finally:
        serve.delete(APP)
    print(
        f"{label}: started in {start_s:.0f} s; {describe(level)}; replicas answering: {replicas}", flush=True
    )
    return {
        "layout": label,
        "args": args,
        "start_s": start_s,
        "replicas_answering": replicas,
        **asdict(level),
    }


def describe(level: LevelReport) -> str:
    total = level.total_s
    latency = "-" if total is None else f"p50 {total.p50:.2f} s, p95 {total.p95:.2f} s"
    audio = "-" if level.audio_s_per_s is None else f"{level.audio_s_per_s:.3f}"
    return (
        f"{level.ok}/{level.requests} ok (errors {level.errors or 'none'}) in {level.wall_s:.1f} s: "
        f"{audio} audio s/s, {level.requests_per_s:.3f} requests/s, latency {latency}"
    )


def answering_replicas(url: str, tokens: int) -> int:
    """Replicas seen in the headers of a few concurrent requests (a check that the load
    was spread)."""
    body = {"model": "tts-1", "input": "Hi.", "voice": VOICE, "response_format": "pcm"}
    body |= {"min_tokens": tokens, "max_tokens": tokens}
    with httpx.Client(timeout=600) as client, ThreadPoolExecutor(6) as pool:
        replies = pool.map(lambda _: client.post(f"{url}/v1/audio/speech", json=body), range(6))
        seen = {reply.headers[REPLICA_HEADER] for reply in replies}
    return len(seen)


def replica_states() -> dict[str, int]:
    states = serve.status().applications[APP].deployments[DEPLOYMENT_NAME].replica_states
    return {str(state): count for state, count in states.items()}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def loadavg() -> str:
    return Path("/proc/loadavg").read_text().strip()


if __name__ == "__main__":
    main()
