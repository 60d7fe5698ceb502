"""The playground page (``/`` and ``/playground/*``): its files in-process, then the page in a
real headless Chromium (Debian's, driven by Playwright) against one server on the tiny model
with authentication on: the API's error without a key, the typed key, streamed synthesis
with its timings, the WAV and MP3 downloads, a voice added from a file and from the
microphone.

Screenshots go to the test's temporary directory (``--basetemp`` chooses where); with
``COSYSERVE_UPDATE_SCREENSHOT=1`` the README's is also copied to docs/images/playground.png."""

import io
import math
import os
import shutil
import time
import wave
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
from fastapi.testclient import TestClient
from playwright.sync_api import BrowserContext, Page, expect, sync_playwright

from cosyserve.server.auth.keys import hash_secret
from cosyserve.server.http.app import create_app
from cosyserve.server.http.routes.playground import CONTENT_SECURITY_POLICY
from cosyserve.server.settings import Settings
from tests.server.audio_check import SECONDS_PER_TOKEN, decode
from tests.server.conftest import ServerProcess, running_server
from tests.server.http_audio import BUILTIN, PROMPT_TEXT, SAMPLE_RATE, assert_same_pcm, prompt_wav

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    # A fake microphone (a beep) that needs no permission prompt, for the recording.
    "--use-fake-device-for-media-stream",
    "--use-fake-ui-for-media-stream",
]
README_SCREENSHOT = Path(__file__).parents[2] / "docs" / "images" / "playground.png"
API_KEY = "csk_playground_key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
KEY_FIELD = "Key (when the server has authentication on)"
# Forced speech tokens: 1.2 s of audio; with a built-in speaker the server streams it in two
# chunks, 25 tokens and the rest (docs/streaming.md).
TOKENS = 30
SAMPLES = round(TOKENS * SECONDS_PER_TOKEN * SAMPLE_RATE)
MP3_SLACK_S = 0.12  # encoder delay and frame padding
TIMEOUT_S = 60.0
T = TypeVar("T")


# -- the files, in-process (no model) --------------------------------------------------------------


@pytest.fixture(scope="module")
def app_client() -> TestClient:
    """The app with authentication on (a key): the lifespan does not run, so no model loads."""
    settings = Settings.load(auth_api_keys=f"svc:{hash_secret(API_KEY, log2_n=10)}", grpc_port=0)
    return TestClient(create_app(settings))


@pytest.mark.parametrize(
    ("path", "media_type"),
    [
        ("/", "text/html; charset=utf-8"),
        ("/playground/app.js", "text/javascript; charset=utf-8"),
        ("/playground/style.css", "text/css; charset=utf-8"),
    ],
)
def test_page_and_assets_load_without_a_key(app_client: TestClient, path: str, media_type: str) -> None:
    response = app_client.get(path)
    assert response.status_code == 200
    assert response.headers["content-type"] == media_type
    assert response.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
    assert response.headers["x-content-type-options"] == "nosniff"
    assert len(response.content) > 500


def test_only_the_page_is_open(app_client: TestClient) -> None:
    assert app_client.get("/v1/audio/voices").status_code == 401  # the API still needs the key
    assert app_client.get("/playground/settings.py").status_code == 401  # not an open path
    missing = app_client.get("/playground/settings.py", headers=AUTH)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"


def test_page_has_no_inline_code_and_loads_only_its_own_assets(app_client: TestClient) -> None:
    html = app_client.get("/").text
    assert "<script>" not in html and "<style" not in html and "onclick" not in html
    assert 'src="/playground/app.js"' in html and 'href="/playground/style.css"' in html
    assert "http://" not in html and "https://" not in html  # nothing from elsewhere
    assert "script-src 'self'" in CONTENT_SECURITY_POLICY and "'unsafe-inline'" not in CONTENT_SECURITY_POLICY


# -- the page in Chromium --------------------------------------------------------------------------


def _processes_with(needle: str) -> list[int]:
    """Ids of live processes whose command line holds ``needle``."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and needle in (proc / "cmdline").read_bytes().decode(errors="replace"):
                found.append(int(proc.name))
        except OSError:  # exited meanwhile
            pass
    return found


@contextmanager
def _chromium(profile: Path) -> Iterator[BrowserContext]:
    """Debian's Chromium, headless, with a fresh profile; afterwards no process of it is left."""
    with sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            profile,
            executable_path=CHROMIUM,
            headless=True,
            args=CHROMIUM_ARGS,
            accept_downloads=True,
            viewport={"width": 1100, "height": 820},
        )
        context.set_default_timeout(TIMEOUT_S * 1000)
        try:
            yield context
        finally:
            context.close()
    deadline = time.monotonic() + 10
    while (left := _processes_with(str(profile))) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"Chromium processes left running: {left}"


@contextmanager
def _entered_in_background(manager: AbstractContextManager[T]) -> Iterator[Future[T]]:
    """Enter ``manager`` in a thread while the caller does something else; always exit it."""
    with ThreadPoolExecutor(1) as pool:
        entered = pool.submit(manager.__enter__)
        try:
            yield entered
        finally:
            if entered.exception() is None:  # a failed start has stopped what it started
                manager.__exit__(None, None, None)


@dataclass
class Playground:
    server: ServerProcess
    browser: BrowserContext


@pytest.fixture(scope="module")
def playground(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Playground]:
    """One server for the browser tests, with authentication on (the key field is part of
    every test), and one Chromium, started side by side. A missing browser fails (it is part
    of the default run), it does not skip."""
    if not CHROMIUM.exists():
        pytest.fail(
            f"{CHROMIUM} is missing: run `bash scripts/install` as root, or "
            "`apt-get install -y --no-install-recommends chromium chromium-driver fonts-wqy-zenhei`",
            pytrace=False,
        )
    tmp = tmp_path_factory.mktemp("playground-server")
    config = tmp / "auth.toml"
    config.write_text(f'auth_api_keys = "svc:{hash_secret(API_KEY, log2_n=10)}"\n')
    server = running_server(tiny_model_dir, tmp, config=config, auth_mode="on")
    with _entered_in_background(server) as started, _chromium(tmp / "chromium-profile") as browser:
        yield Playground(started.result(), browser)
    assert started.result().process.poll() is not None


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("playground-screenshots")


def _api_error(response: httpx.Response) -> str:
    """What the page shows for an API error: the API's own message and the status."""
    return f"{response.json()['error']['message']} (HTTP {response.status_code})"


def _open(playground: Playground) -> Page:
    """The page, loaded without a key (the API refuses its first voice list), then given the
    key in its field."""
    server = playground.server
    page = playground.browser.new_page()
    page.goto(f"{server.url}/")
    refused = httpx.get(f"{server.url}/v1/audio/voices", timeout=30)
    assert refused.status_code == 401
    expect(page.get_by_role("alert")).to_have_text(_api_error(refused))
    page.get_by_label(KEY_FIELD).fill(API_KEY)
    page.keyboard.press("Tab")  # the key is taken on change; the voices load with it
    expect(page.get_by_label("Voice", exact=True).locator("option")).to_contain_text([BUILTIN])
    expect(page.get_by_role("alert")).to_have_text("")
    return page


def _wait_for(page: Page, expression: str) -> None:
    """Poll ``expression`` in the page. (Playwright's wait_for_function evaluates its
    predicate with eval(), which the page's Content-Security-Policy rightly refuses.)"""
    deadline = time.monotonic() + TIMEOUT_S
    while not page.evaluate(expression):
        assert time.monotonic() < deadline, f"not true after {TIMEOUT_S} s: {expression}"
        page.wait_for_timeout(50)


def _speak(page: Page, *, keyboard: bool = False) -> dict[str, Any]:
    """Speak (the button, or Ctrl+Enter in the text) and wait for the synthesis to end; the
    page's record of the audio it received and played."""
    runs = page.evaluate("window.__playground.runs")
    if keyboard:
        page.get_by_label("Text", exact=True).press("Control+Enter")
    else:
        page.get_by_role("button", name="Speak", exact=True).click()
    _wait_for(page, f"window.__playground.runs > {runs}")
    error = page.evaluate("window.__playground.lastError")
    assert error is None, error
    audio: dict[str, Any] = page.evaluate("window.__playground.lastAudio")
    assert audio["sampleRate"] == SAMPLE_RATE
    assert audio["seconds"] == pytest.approx(audio["samples"] / SAMPLE_RATE)
    assert 0 < audio["firstAudioMs"] <= audio["wallMs"]
    assert audio["rtf"] == pytest.approx(audio["wallMs"] / 1000 / audio["seconds"])
    assert audio["scheduledS"] == pytest.approx(audio["seconds"])  # all of it went to Web Audio
    # The timings are shown, as the page measured them.
    # Math.round: halves up (Python's round() takes them to the even neighbour).
    expect(page.locator("#ttfa")).to_have_text(f"{math.floor(audio['firstAudioMs'] + 0.5)} ms")
    expect(page.locator("#rtf")).to_have_text(f"{audio['rtf']:.2f}")
    expect(page.locator("#duration")).to_have_text(f"{audio['seconds']:.2f} s")
    return audio


def _download(page: Page, button: str) -> bytes:
    with page.expect_download() as download:
        page.get_by_role("button", name=button).click()
    return download.value.path().read_bytes()


def _wav_pcm(data: bytes) -> bytes:
    with wave.open(io.BytesIO(data)) as wav:
        assert (wav.getnchannels(), wav.getsampwidth(), wav.getframerate()) == (1, 2, SAMPLE_RATE)
        return wav.readframes(wav.getnframes())


def _force_length(page: Page, seed: int) -> None:
    page.get_by_text("Options").click()
    page.get_by_label("Seed", exact=True).fill(str(seed))
    page.get_by_label("Speech tokens per sentence").fill(str(TOKENS))


def _add_voice(page: Page, name: str, transcript: str, audio_file: Path | None = None) -> None:
    page.get_by_label("Name", exact=True).fill(name)
    if audio_file is not None:
        page.get_by_label("Recording: a file (0.5–30 s)").set_input_files(audio_file)
    page.get_by_label("Transcript", exact=True).fill(transcript)
    page.get_by_role("button", name="Add voice", exact=True).click()
    expect(page.get_by_role("status")).to_have_text(f"Voice {name} added.")
    expect(page.get_by_label("Voice", exact=True)).to_have_value(name)


UNLABELLED = """[...document.querySelectorAll("input, select, textarea, button")]
  .filter((el) => !(el.labels?.length || el.textContent.trim()))
  .map((el) => el.id || el.outerHTML)"""


def test_controls_are_labelled_and_the_key_lives_only_in_the_page(playground: Playground) -> None:
    page = _open(playground)
    try:
        assert page.evaluate(UNLABELLED) == []  # native controls, each with a label or its text
        assert page.get_by_label(KEY_FIELD).get_attribute("type") == "password"
        assert page.evaluate("localStorage.length + sessionStorage.length") == 0
        assert playground.browser.cookies() == []
        page.reload()
        expect(page.get_by_label(KEY_FIELD)).to_have_value("")
        expect(page.get_by_role("alert")).to_contain_text("(HTTP 401)")
    finally:
        page.close()


def test_speak_download_and_add_voices(playground: Playground, shots: Path) -> None:
    url = playground.server.url
    page = _open(playground)
    voice = page.get_by_label("Voice", exact=True)
    mode = page.get_by_label("Mode", exact=True)

    # A built-in speaker (sft), streamed into Web Audio piece by piece; Ctrl+Enter speaks.
    page.get_by_label("Text", exact=True).fill("Hello there.")
    voice.select_option(BUILTIN)
    expect(mode).to_have_value("sft")
    _force_length(page, seed=3)
    audio = _speak(page, keyboard=True)
    assert (audio["samples"], audio["route"]) == (SAMPLES, "/v1/audio/speech")
    assert audio["pieces"] >= 2
    page.screenshot(path=shots / "speak.png", full_page=True)

    # The WAV is what the page received: the server's audio for that seed, sample for sample.
    heard = _wav_pcm(_download(page, "Download WAV"))
    body = {
        "model": "m",
        "input": "Hello there.",
        "voice": BUILTIN,
        "response_format": "pcm",
        "stream": True,
        "seed": 3,
        "min_tokens": TOKENS,
        "max_tokens": TOKENS,
    }
    direct = httpx.post(f"{url}/v1/audio/speech", json=body, headers=AUTH, timeout=60)
    assert_same_pcm(heard, direct.content)
    mp3 = decode(_download(page, "Download MP3"), "mp3")
    assert mp3.sample_rate == SAMPLE_RATE
    assert mp3.duration == pytest.approx(TOKENS * SECONDS_PER_TOKEN, abs=MP3_SLACK_S)

    # An error is the API's own message.
    page.get_by_label("Text", exact=True).fill("")
    page.get_by_role("button", name="Speak", exact=True).click()
    refused = httpx.post(f"{url}/v1/audio/speech", json={**body, "input": ""}, headers=AUTH, timeout=60)
    assert 400 <= refused.status_code < 500
    expect(page.get_by_role("alert")).to_have_text(_api_error(refused))
    page.get_by_label("Text", exact=True).fill("Hello there.")

    added = ["pg-file", "pg-mic"]
    try:
        # A voice from a file, with its transcript: zero-shot through /v1/audio/speech.
        prompt = shots / "prompt.wav"
        prompt.write_bytes(prompt_wav(seconds=1.5))
        _add_voice(page, added[0], PROMPT_TEXT, prompt)
        expect(mode).to_have_value("zero_shot")
        audio = _speak(page)
        assert (audio["samples"], audio["mode"]) == (SAMPLES, "zero_shot")

        # instruct2 with an instruction.
        mode.select_option("instruct2")
        page.get_by_label("Instruction", exact=True).fill("Speak slowly.")
        audio = _speak(page)
        assert (audio["samples"], audio["mode"]) == (SAMPLES, "instruct2")

        # Cross-lingual with a voice that has a transcript: upstream's route names the mode.
        mode.select_option("cross_lingual")
        audio = _speak(page)
        assert audio["route"] == "/inference_cross_lingual" and audio["samples"] > 0
        expect(page.get_by_role("button", name="Download MP3")).to_be_disabled()

        # A voice recorded in the page (Chromium's fake microphone), without a transcript.
        page.get_by_role("button", name="Record", exact=True).click()
        expect(page.locator("#record-state")).to_have_text("Recording…")
        page.wait_for_timeout(1500)
        page.get_by_role("button", name="Stop recording").click()
        expect(page.locator("#record-state")).to_contain_text("Recorded")
        _add_voice(page, added[1], "")
        expect(mode).to_have_value("cross_lingual")
        assert mode.locator("option[value=zero_shot]").is_disabled()
        page.get_by_label("Text", exact=True).fill("Hello from a voice recorded in the browser.")
        audio = _speak(page)
        assert (audio["samples"], audio["route"]) == (SAMPLES, "/v1/audio/speech")
        page.screenshot(path=shots / "playground.png")
        if os.environ.get("COSYSERVE_UPDATE_SCREENSHOT") == "1":
            README_SCREENSHOT.parent.mkdir(exist_ok=True)
            shutil.copyfile(shots / "playground.png", README_SCREENSHOT)
    finally:
        page.close()
        for name in added:
            httpx.delete(f"{url}/v1/audio/voices/{name}", headers=AUTH, timeout=30)
