"""The ``--workers`` supervisor: a worker that dies is replaced; SIGHUP reaches every worker."""

import os
import signal
import time
from pathlib import Path

import httpx

from tests.server.conftest import ServerProcess, running_server

VOICE = "英文男"


def test_dead_worker_is_replaced_and_sighup_reaches_all(tiny_model_dir: Path, tmp_path: Path) -> None:
    words = tmp_path / "words.txt"
    words.write_text("forbidden\n")
    config = tmp_path / "cosyserve.toml"
    config.write_text(f'sensitive_words_file = "{words}"\n')
    with running_server(tiny_model_dir, tmp_path, workers=2, config=config) as server:
        first = _workers(server.process.pid)
        assert len(first) == 2
        _wait_log(server, '"msg": "ready: model', 2)

        os.kill(first[0], signal.SIGKILL)  # as the OOM killer would
        deadline = time.monotonic() + 120
        while (now := _workers(server.process.pid)) == first or len(now) != 2:
            assert server.process.poll() is None, server.log()
            assert time.monotonic() < deadline, now
            time.sleep(0.2)
        assert first[1] in now and first[0] not in now
        _wait_log(server, '"msg": "ready: model', 3)  # the two first workers and the new one
        body = {"model": "x", "input": "Hi.", "voice": VOICE, "response_format": "wav"}
        body |= {"min_tokens": 5, "max_tokens": 5}
        assert httpx.post(f"{server.url}/v1/audio/speech", json=body, timeout=60).status_code == 200
        assert "starting a new one" in server.log()

        loaded = server.log().count("sensitive words: 1 loaded")
        server.process.send_signal(signal.SIGHUP)
        _wait_log(server, "sensitive words: 1 loaded", loaded + 2)  # once per worker
        time.sleep(0.5)
        assert _workers(server.process.pid) == now  # SIGHUP stopped no worker
        assert server.log().count("starting a new one") == 1


def _wait_log(server: ServerProcess, line: str, count: int) -> None:
    deadline = time.monotonic() + 120
    while server.log().count(line) < count:
        assert server.process.poll() is None, server.log()
        assert time.monotonic() < deadline, server.log()
        time.sleep(0.1)


def _workers(pid: int) -> list[int]:
    """Child processes of ``pid`` other than multiprocessing's resource tracker."""
    children = [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    return [c for c in children if b"resource_tracker" not in Path(f"/proc/{c}/cmdline").read_bytes()]
