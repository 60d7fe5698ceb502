"""One server process serving CosyVoice 2 and CosyVoice 3 at once, picked by the request's
``model``: the model list, readiness, routing (ids, family aliases, unknown names), a voice
registered once for both families, per-model metrics. One app for the module: loading two
models is the slow part."""

import io
import os
import time
import uuid
import wave
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient

from cosyserve.server.error_map import ModelNotFoundError, NotReadyError
from cosyserve.server.http.app import create_app
from cosyserve.server.runtime import Phase, ServerRuntime, _family_aliases
from cosyserve.server.settings import Settings
from tests.server.http_audio import BUILTIN, PROMPT_TEXT, assert_same_pcm, assert_speechlike_pcm, prompt_wav

TEXT = "Hi."
TOKENS = {"min_tokens": 20, "max_tokens": 20}


@pytest.fixture(scope="module")
def client(
    tiny_model_dir: Path, tiny3_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TestClient]:
    tmp = tmp_path_factory.mktemp("multi")
    with pytest.MonkeyPatch.context() as patch:
        for name in [n for n in os.environ if n.startswith("COSYSERVE_")]:
            patch.delenv(name)
        settings = Settings.load(
            model_dir=(tiny_model_dir, tiny3_model_dir),
            voices_db=tmp / "voices.sqlite3",
            grpc_port=0,
            profile="exact",
            auth_mode="none",
        )
        with TestClient(create_app(settings)) as test_client:
            deadline = time.monotonic() + 240
            while test_client.get("/ready").status_code != 200:
                runtime: ServerRuntime = test_client.app.state.runtime  # type: ignore[attr-defined]
                # READY can come between the 503 above and this line: only a failed start stops.
                assert runtime.phase is not Phase.FAILED, "the server did not start"
                assert time.monotonic() < deadline, "the server did not get ready"
                time.sleep(0.1)
            yield test_client


def speak(client: TestClient, model: str, **extra: Any) -> Any:
    body = {"model": model, "input": TEXT, "voice": BUILTIN, "response_format": "wav", "seed": 3, **TOKENS}
    return client.post("/v1/audio/speech", json={**body, **extra})


def wav_pcm(data: bytes) -> bytes:
    with wave.open(io.BytesIO(data)) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 24000)
        return w.readframes(w.getnframes())


def test_models_lists_both(client: TestClient) -> None:
    response = client.get("/v1/models")
    assert response.status_code == 200
    assert [card["id"] for card in response.json()["data"]] == ["tiny", "tiny3"]


def test_ready_and_health_show_each_model(client: TestClient) -> None:
    ready = client.get("/ready").json()
    assert ready["status"] == "ready" and ready["model"] == "tiny" and ready["engine_alive"]
    assert ready["models"] == {"tiny": "ready", "tiny3": "ready"}
    health = client.get("/health").json()
    assert set(health["plans"]) == {"tiny", "tiny3"} and health["plan"] == health["plans"]["tiny"]


def test_speech_picks_the_model(client: TestClient) -> None:
    audio = {}
    for model in ("tiny", "tiny3", "cosyvoice3"):  # an id, an id, a family alias
        response = speak(client, model)
        assert response.status_code == 200, response.text
        audio[model] = wav_pcm(response.content)
        assert_speechlike_pcm(audio[model])
    assert_same_pcm(audio["tiny3"], audio["cosyvoice3"])
    cv2, cv3 = (np.frombuffer(audio[m], "<i2") for m in ("tiny", "tiny3"))
    assert cv2.size != cv3.size or not np.array_equal(cv2, cv3)  # two models, two voices
    streamed = speak(client, "tiny3", response_format="pcm", stream=True)
    assert streamed.status_code == 200
    assert_speechlike_pcm(streamed.content)


def test_unknown_model_is_a_404(client: TestClient) -> None:
    response = speak(client, "gpt-4o-mini-tts")
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["code"] == "model_not_found" and error["type"] == "invalid_request_error"
    assert error["message"] == "model 'gpt-4o-mini-tts' is not served here; served models: tiny, tiny3"


def test_tts_takes_a_model(client: TestClient) -> None:
    query = {"text": TEXT, "voice": BUILTIN, "seed": 3, **TOKENS}
    default = client.get("/tts", params=query)
    cv2 = client.get("/tts", params={**query, "model": "cosyvoice2"})
    cv3 = client.get("/tts", params={**query, "model": "tiny3"})
    assert default.status_code == cv2.status_code == cv3.status_code == 200
    assert_same_pcm(wav_pcm(default.content), wav_pcm(cv2.content))
    assert wav_pcm(cv3.content) != wav_pcm(cv2.content)
    assert client.get("/tts", params={**query, "model": "nope"}).json()["error"]["code"] == "model_not_found"


def test_a_voice_registered_once_serves_both_models(client: TestClient) -> None:
    name = f"both_{uuid.uuid4().hex[:8]}"
    files = {"audio": ("prompt.wav", prompt_wav(seed=4), "audio/wav")}
    registered = client.post("/v1/audio/voices", data={"name": name, "transcript": PROMPT_TEXT}, files=files)
    assert registered.status_code == 201, registered.text
    listed = [v["name"] for v in client.get("/v1/audio/voices").json()["voices"]]
    assert listed.count(name) == 1 and listed.count(BUILTIN) == 1
    runtime: ServerRuntime = client.app.state.runtime  # type: ignore[attr-defined]
    cv2_voice, cv3_voice = (runtime.models[m].voices.get(name) for m in ("tiny", "tiny3"))
    assert cv2_voice is not None and cv3_voice is not None  # each family's own features
    for model in ("tiny", "tiny3"):
        response = speak(client, model, voice=name)
        assert response.status_code == 200, response.text
        assert_speechlike_pcm(wav_pcm(response.content))
    again = client.post("/v1/audio/voices", data={"name": name}, files=files)
    assert again.status_code == 409
    assert client.delete(f"/v1/audio/voices/{name}").status_code == 204
    assert (
        runtime.models["tiny"].voices.get(name) is None and runtime.models["tiny3"].voices.get(name) is None
    )
    for model in ("tiny", "tiny3"):
        assert speak(client, model, voice=name).status_code == 404


def test_a_voice_stored_for_one_family_only_says_so(client: TestClient) -> None:
    """A voice registered while only CosyVoice 2 was served has no CosyVoice 3 features."""
    runtime: ServerRuntime = client.app.state.runtime  # type: ignore[attr-defined]
    name = f"old_{uuid.uuid4().hex[:8]}"
    cv2 = runtime.models["tiny"]
    cv2.voices.put(cv2.frontend.voice_from_audio(prompt_wav(seed=5), PROMPT_TEXT, name))
    assert speak(client, "tiny", voice=name).status_code == 200
    response = speak(client, "tiny3", voice=name)
    assert response.status_code == 404
    assert "register it again" in response.json()["error"]["message"]
    assert client.delete(f"/v1/audio/voices/{name}").status_code == 204


def test_metrics_count_requests_by_model(client: TestClient) -> None:
    speak(client, "tiny3")
    metrics = client.get("/metrics").text
    assert 'cosyserve_model_requests_total{model="tiny3",route="/v1/audio/speech",status="200"}' in metrics
    assert 'cosyserve_model_engine_alive{model="tiny"} 1.0' in metrics
    assert "cosyserve_engine_alive 1.0" in metrics


def _runtime(*models: tuple[str, str]) -> ServerRuntime:
    """A runtime marked ready over fake services of (id, family)."""
    runtime = ServerRuntime(Settings(model_dir=tuple(Path("/m") / m for m, _ in models)))
    for model_id, family in models:
        model = SimpleNamespace(model_dir=SimpleNamespace(family=SimpleNamespace(value=family)))
        runtime.models[model_id] = SimpleNamespace(model=model)  # type: ignore[assignment]
    runtime.service = runtime.models[models[0][0]]
    runtime._aliases = _family_aliases(runtime.models)
    runtime.phase = Phase.READY
    return runtime


def test_one_model_takes_any_name() -> None:
    runtime = _runtime(("CosyVoice2-0.5B", "cosyvoice2"))
    for name in (None, "tts-1", "CosyVoice2-0.5B", "cosyvoice3"):
        assert runtime.require_service(name) is runtime.service


def test_names_match_ids_then_unambiguous_families() -> None:
    runtime = _runtime(("a", "cosyvoice2"), ("b", "cosyvoice2"), ("c", "cosyvoice3"))
    assert runtime.require_service(None) is runtime.models["a"]
    assert runtime.require_service("b") is runtime.models["b"]
    assert runtime.require_service("cosyvoice3") is runtime.models["c"]
    with pytest.raises(ModelNotFoundError, match="served models: a, b, c"):
        runtime.require_service("cosyvoice2")  # two models of that family: ambiguous
    # An id wins over a family name.
    named = _runtime(("cosyvoice3", "cosyvoice2"), ("x", "cosyvoice3"))
    assert named.require_service("cosyvoice3") is named.models["cosyvoice3"]
    named.phase = Phase.DRAINING
    with pytest.raises(NotReadyError):
        named.require_service("x")
