"""The ``pronunciations`` setting in a real server: read at start for the served model's
family, read again on SIGHUP, and a broken file on reload keeps the dictionary in use."""

import signal
import time
from pathlib import Path

import httpx

from tests.server.conftest import ServerProcess, running_server


def _wait_for(server: ServerProcess, line: str, count: int = 1) -> None:
    deadline = time.monotonic() + 60
    while server.log().count(line) < count:
        assert server.process.poll() is None, server.log()
        assert time.monotonic() < deadline, server.log()[-3000:]
        time.sleep(0.1)


def test_dictionary_loads_and_reloads_on_sighup(tiny3_model_dir: Path, tmp_path: Path) -> None:
    words = tmp_path / "pronunciations.txt"
    words.write_text("银行 yin2 hang2\n重庆 chong2 qing4\n", encoding="utf-8")
    with running_server(tiny3_model_dir, tmp_path, pronunciations=words) as server:
        _wait_for(server, f"pronunciations from {words} (cosyvoice3: 2 words)")

        words.write_text("银行 yin2 hang2\n重庆 chong2 qing4\n长大 zhang3 da4\n", encoding="utf-8")
        server.process.send_signal(signal.SIGHUP)
        _wait_for(server, f"pronunciations from {words} (cosyvoice3: 3 words)")

        words.write_text("还钱 huan9 qian2\n", encoding="utf-8")  # no tone 9: refused whole
        server.process.send_signal(signal.SIGHUP)
        _wait_for(server, "pronunciations not reloaded, the old ones stay")
        assert f"{words}:1: 还钱:" in server.log()

        body = {"model": "x", "input": "我在银行工作。", "voice": "中文女", "response_format": "wav"}
        body |= {"min_tokens": 5, "max_tokens": 5}
        response = httpx.post(f"{server.url}/v1/audio/speech", json=body, timeout=60)
        assert response.status_code == 200 and response.content[:4] == b"RIFF"
