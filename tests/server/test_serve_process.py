"""``cosyserve serve`` as a process: start-up errors, readiness, graceful SIGTERM, workers."""

import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import grpc
import httpx
import pytest
from typer.testing import CliRunner

from cosyserve.cli.main import app
from cosyserve.server.grpc.protos import cosyserve_v1_pb2, cosyserve_v1_pb2_grpc
from tests.server.conftest import (
    ServerProcess,
    isolated_env,
    running_server,
    serve_command,
    server_args,
)

VOICE = "英文男"


def run_serve(tmp: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        serve_command(*args), env=isolated_env(tmp), capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--port", "70000"], "error: invalid setting port: Input should be less than or equal to 65535"),
        (
            ["--max-active", "0"],
            "error: invalid setting max_active: Input should be greater than or equal to 1",
        ),
        (["--model-dir", "/nonexistent/model"], "error: model directory /nonexistent/model does not exist"),
        (
            ["--config", "/nonexistent/cosyserve.toml"],
            "error: config file /nonexistent/cosyserve.toml does not exist",
        ),
        (["--dtype", "fp16"], "error: fp16 needs a CUDA device"),  # before any worker starts
    ],
)
def test_bad_settings_stop_the_start_in_one_line(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str], message: str
) -> None:
    # In-process (the CLI's error path; the real process is started by the other tests).
    _isolate(monkeypatch, tmp_path)
    result = CliRunner().invoke(app, ["serve", "--model-dir", str(tiny_model_dir), *args])
    assert result.exit_code == 2
    assert result.stderr.startswith(message) and result.stderr.count("\n") == 1


def test_precision_setting_this_machine_cannot_run(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _isolate(monkeypatch, tmp_path)
    monkeypatch.setenv("COSYSERVE_QUANTIZE", "int4")
    result = CliRunner().invoke(app, ["serve", "--model-dir", str(tiny_model_dir)])
    assert result.exit_code == 2
    assert result.stderr == (
        "error: int4 quantization needs a CUDA device (there is no fast CPU int4 kernel); "
        "on CPU use --quantize int8\n"
    )


def test_unknown_key_in_config_file(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _isolate(monkeypatch, tmp_path)
    config = tmp_path / "cosyserve.toml"
    config.write_text("max_actives = 3\n")
    result = CliRunner().invoke(app, ["serve", "--model-dir", str(tiny_model_dir), "--config", str(config)])
    assert (result.exit_code, result.stderr) == (2, f"error: unknown setting 'max_actives' in {config}\n")


def test_model_that_fails_to_load_exits_2(tiny_model_dir: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    for entry in tiny_model_dir.iterdir():
        (broken / entry.name).symlink_to(entry)
    (broken / "llm.pt").unlink()
    (broken / "llm.pt").write_bytes((tiny_model_dir / "llm.pt").read_bytes()[:1000])
    result = run_serve(tmp_path, *server_args(broken, tmp_path))
    assert result.returncode == 2
    assert result.stderr.strip().endswith("error: the server could not start; see the log above")
    assert "server start failed:" in result.stderr and "llm.pt" in result.stderr
    assert "Traceback" not in result.stderr


def test_ready_grpc_and_graceful_sigterm(tiny_model_dir: Path, tmp_path: Path) -> None:
    """/ready is 503 while loading; gRPC runs in the same process on the same service; on
    SIGTERM a short stream finishes, one longer than the grace period is cut off, and the
    process exits 0 soon after the grace period."""
    grace = 6.0
    states: list[str] = []
    grpc_port = _free_port()
    with running_server(
        tiny_model_dir, tmp_path, shutdown_grace=grace, grpc_port=grpc_port, on_listening=states.append
    ) as server:
        assert states[0] == "starting"
        assert f"gRPC listening on 127.0.0.1:{grpc_port}" in server.log()
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            voices = cosyserve_v1_pb2_grpc.SpeechStub(channel).ListVoices(
                cosyserve_v1_pb2.ListVoicesRequest(), timeout=10
            )
        assert sorted(v.name for v in voices.voices) == ["中文女", "英文男"]
        results: dict[str, object] = {}

        def stream(name: str, tokens: int) -> None:
            body = {"model": "x", "input": "Hello.", "voice": VOICE, "response_format": "pcm", "stream": True}
            body |= {"min_tokens": tokens, "max_tokens": tokens}
            received = 0
            try:
                with httpx.stream("POST", f"{server.url}/v1/audio/speech", json=body, timeout=60) as response:
                    for piece in response.iter_bytes():
                        received += len(piece)
                results[name] = received
            except httpx.HTTPError as exc:
                results[name] = exc

        short_tokens = 100  # about 1 s on the tiny model: still running at SIGTERM, done in the grace
        long = threading.Thread(target=stream, args=("long", 5000))
        short = threading.Thread(target=stream, args=("short", short_tokens))
        threads = [long, short]
        long.start()
        _wait_engine_requests(server, 1)
        short.start()
        _wait_engine_requests(server, 2)
        server.process.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        assert server.process.wait(grace + 15) == 0
        stopped_after = time.monotonic() - sent
        for thread in threads:
            thread.join(10)
    assert results["short"] == short_tokens * 960 * 2  # finished within the grace period
    assert isinstance(results["long"], httpx.RemoteProtocolError)  # cut off after it
    assert grace - 0.5 < stopped_after < grace + 10
    log = server.log()
    assert "draining" in log and "grace period over: aborting 1 request(s)" in log
    assert "Traceback" not in log


@pytest.mark.slow
def test_two_workers_share_one_port(tiny_model_dir: Path, tmp_path: Path) -> None:
    with running_server(tiny_model_dir, tmp_path, workers=2) as server:
        assert len(_workers(server.process.pid)) == 2
        deadline = time.monotonic() + 120
        while [server.ready().status_code for _ in range(10)] != [200] * 10:  # both workers
            assert time.monotonic() < deadline
            time.sleep(0.2)
        body = {"model": "x", "input": "Hi.", "voice": VOICE, "response_format": "wav"}
        body |= {"min_tokens": 10, "max_tokens": 10}
        response = httpx.post(f"{server.url}/v1/audio/speech", json=body, timeout=60)
        assert response.status_code == 200


def _wait_engine_requests(server: ServerProcess, count: int) -> None:
    deadline = time.monotonic() + 30
    while server.ready().json()["engine_requests"] < count:
        assert time.monotonic() < deadline, f"fewer than {count} requests reached the engine"
        time.sleep(0.02)


def _isolate(monkeypatch: pytest.MonkeyPatch, tmp: Path) -> None:
    for name in [n for n in os.environ if n.startswith("COSYSERVE_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp / "cache"))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _workers(pid: int) -> list[int]:
    """Child processes of ``pid`` other than multiprocessing's resource tracker."""
    children = [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    return [c for c in children if b"resource_tracker" not in Path(f"/proc/{c}/cmdline").read_bytes()]
