"""Time from ``cosyserve serve`` to ``/ready``, with the start-up phases the server logs.

    python benchmarks/startup.py --model-dir /tmp/cv2-full [--repeats 2] [--starts 2]
        [--json out.json] [serve flags, e.g. --quantize int8 --flow-quantize fp16]

Each repeat gives the server a new, empty cache directory (``XDG_CACHE_HOME``: traces,
voices, audio cache) and starts it ``--starts`` times in it, one after the other: the
first start is cold (nothing of cosyserve's cached; the OS keeps the model's files in its
page cache either way), the later ones warm. Flags the script does not know go to
``serve``, which runs with ``--auth-mode none``, a free HTTP port, no gRPC and JSON logs,
on this interpreter and environment: ``PYTHONPATH=/other/src`` times another checkout.

A start's wall time runs from spawning the process to the first 200 from ``/ready``.
Each phase is the duration its log line states (``in 2.3 s``), else the time between its
line and the one before it (a server that does not state it); ``listening`` is the
time to the HTTP socket (imports). The server is stopped after each start, and killed if
it does not stop or the script fails.
"""

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

# A phase and its log line; phases overlap where the server runs them side by side.
PHASES = (
    ("listening", re.compile(r"HTTP listening on http://[^:]+:(?P<port>\d+)")),
    ("verify", re.compile(r"model files (?:of \S+ )?verified in (?P<s>[\d.]+) s")),
    ("load", re.compile(r"^loaded .* in (?P<s>[\d.]+) s")),
    ("decode traces", re.compile(r"decode steps .*?(?: in (?P<s>[\d.]+) s|$)")),
    ("flow traces", re.compile(r"^flow steps .*?(?: in (?P<s>[\d.]+) s|$)")),
    ("warm-up", re.compile(r"^warm-up done.*?(?: in (?P<s>[\d.]+) s|$)")),
    ("ready", re.compile(r"^ready: model")),
)
SERVE = "from cosyserve.cli.main import main; main()"
TIMEOUT_S = 900.0


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=1, help="new cache directories")
    parser.add_argument("--starts", type=int, default=2, help="starts per cache directory")
    parser.add_argument("--json", type=Path)
    args, serve_flags = parser.parse_known_args()
    # SIGTERM ends the script through its cleanup too: the server it started is stopped.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    runs = []
    for repeat in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="cosyserve-startup-") as cache:
            for start in range(args.starts):
                run = time_start(args.model_dir, serve_flags, Path(cache))
                run |= {"repeat": repeat, "start": "cold" if start == 0 else "warm"}
                print(json.dumps(run), flush=True)
                runs.append(run)
    report = {"model_dir": str(args.model_dir), "serve_flags": serve_flags, "runs": runs}
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))


def time_start(model_dir: Path, serve_flags: list[str], cache: Path) -> dict[str, Any]:
    """Start ``serve`` once with ``cache`` as its cache root; the wall time to ready and
    the phases (see the module docstring)."""
    command = [sys.executable, "-c", SERVE, "serve", "--model-dir", str(model_dir), "--auth-mode", "none"]
    # Its stderr is a pipe here, so the server logs JSON lines.
    command += ["--port", "0", "--grpc-port", "0", *serve_flags]
    env = os.environ | {"XDG_CACHE_HOME": str(cache)}
    start = time.perf_counter()
    server = subprocess.Popen(
        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    lines: list[tuple[float, str]] = []
    reader = threading.Thread(target=_read_log, args=(server, start, lines), daemon=True)
    reader.start()
    try:
        wall = _wait_ready(server, start, lines)
    finally:
        _stop(server)
        reader.join(timeout=10)
    return {"wall_to_ready_s": round(wall, 2), "phases_s": phases(lines)}


def phases(lines: list[tuple[float, str]]) -> dict[str, float]:
    """Each phase whose line was logged: the duration it states, else the time since the
    previous phase's line (or since the spawn)."""
    found: dict[str, float] = {}
    previous = 0.0
    for name, pattern in PHASES:
        match = next(((at, m) for at, msg in lines if (m := pattern.search(msg))), None)
        if match is None:
            continue
        at, groups = match
        stated = groups.groupdict().get("s")
        found[name] = round(float(stated) if stated else at - previous, 2)
        previous = at
    return found


def _read_log(server: "subprocess.Popen[str]", start: float, lines: list[tuple[float, str]]) -> None:
    """Collect (seconds since the spawn, message) of each JSON log line."""
    assert server.stderr is not None
    for line in server.stderr:
        try:
            message = str(json.loads(line)["msg"])
        except (ValueError, KeyError, TypeError):
            message = line.rstrip()
        lines.append((time.perf_counter() - start, message))


def _wait_ready(server: "subprocess.Popen[str]", start: float, lines: list[tuple[float, str]]) -> float:
    """Seconds from ``start`` to the first 200 from ``/ready``."""
    port = None
    while time.perf_counter() - start < TIMEOUT_S:
        if server.poll() is not None:
            tail = "\n".join(message for _, message in lines[-20:])
            raise RuntimeError(f"the server exited with status {server.returncode}:\n{tail}")
        port = port or next((m["port"] for _, msg in lines if (m := PHASES[0][1].search(msg))), None)
        if port is not None and _is_ready(int(port)):
            return time.perf_counter() - start
        time.sleep(0.1)
    raise TimeoutError(f"not ready after {TIMEOUT_S:.0f} s")


def _is_ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=5) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):  # 503 while starting, refused before listening
        return False


def _stop(server: "subprocess.Popen[str]") -> None:
    """SIGTERM (the server drains and exits), then SIGKILL to its whole process group."""
    if server.poll() is None:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


if __name__ == "__main__":
    main()
