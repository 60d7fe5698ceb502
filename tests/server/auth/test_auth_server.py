"""Access control and the input guard on the real server (``cosyserve serve``, tiny model):
the route x credential matrix over HTTP, the WebSocket handshake, gRPC, a JWKS served
from a loopback URL, per-identity audio limits, and the guard with a SIGHUP reload."""

import base64
import json
import signal
import socket
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from cosyserve.server.auth.keys import hash_secret
from cosyserve.server.grpc.protos import cosyserve_v1_pb2, cosyserve_v1_pb2_grpc
from cosyserve.server.http.app import create_app
from cosyserve.server.settings import Settings
from tests.server.auth.jwt_helpers import AUDIENCE, ISSUER, SigningKey, jwks, new_key
from tests.server.conftest import ServerProcess, running_server
from tests.server.http_audio import PROMPT_TEXT, prompt_wav

API_KEY = "csk_test_service_key"
GATEWAY_HEADER = "X-Auth-User"
BUILTIN = "中文女"
TOKENS = 60  # 2.4 s of audio at 25 tokens/s: more than the 1 s/min allowance
BLOCKED = "forbidden phrase"


@dataclass
class AuthServer:
    server: ServerProcess
    grpc_target: str
    key: SigningKey
    words: Path

    @property
    def url(self) -> str:
        return self.server.url


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class _JwksServer:
    """Serves one JWKS document on loopback from a thread; shut down on exit."""

    def __init__(self, body: str) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                data = body.encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.http.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}/.well-known/jwks.json"

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()
        self.thread.join()


@pytest.fixture(scope="module")
def auth_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[AuthServer]:
    tmp = tmp_path_factory.mktemp("auth_server")
    key = new_key("k1")
    issuer_keys = _JwksServer(jwks(key))
    words = tmp / "words.txt"
    words.write_text(f"{BLOCKED}\n")
    config = tmp / "auth.toml"
    config.write_text(
        "\n".join(
            [
                f'auth_api_keys = "svc:{hash_secret(API_KEY, log2_n=10)}"',
                f'auth_basic_users = "erin:{hash_secret("erin-pw", log2_n=10)}"',
                f'auth_jwks = "{issuer_keys.url}"',
                f'auth_jwt_issuer = "{ISSUER}"',
                f'auth_jwt_audience = "{AUDIENCE}"',
                f'auth_gateway_header = "{GATEWAY_HEADER}"',
                'auth_gateway_trusted = "127.0.0.1"',
                'auth_voice_admins = "svc"',
                "rate_limit_audio_s = 1.0",
                "auth_failures_per_min = 0",
                "max_prompt_audio_s = 2.0",  # the matrix fails hundreds of times from one address
                f'sensitive_words_file = "{words}"',
            ]
        )
    )
    grpc_port = _free_port()
    try:
        with running_server(
            tiny_model_dir, tmp, config=config, auth_mode="on", grpc_port=grpc_port, max_active=2
        ) as server:
            yield AuthServer(server, f"127.0.0.1:{grpc_port}", key, words)
    finally:
        issuer_keys.close()


def _basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def _credentials(s: AuthServer) -> dict[str, dict[str, str]]:
    return {
        "none": {},
        "wrong key": {"Authorization": "Bearer csk_wrong"},
        "wrong password": {"Authorization": _basic("erin", "nope")},
        "expired token": {"Authorization": "Bearer " + s.key.token(expires_in=-3600)},
        "wrong audience": {"Authorization": "Bearer " + s.key.token(aud="other")},
        "foreign key": {"Authorization": "Bearer " + new_key("k1").token()},
        "valid key": {"Authorization": f"Bearer {API_KEY}"},
        "valid basic": {"Authorization": _basic("erin", "erin-pw")},
        "valid token": {"Authorization": "Bearer " + s.key.token("zoe")},
        "valid gateway": {GATEWAY_HEADER: "gw-user"},
    }


# Each route's request and its status once authenticated: requests that fail the route's
# own checks (no synthesis), so the matrix is quick. Routes missing here fail the test.
_UPSTREAM = ("/inference_sft", "/inference_zero_shot", "/inference_cross_lingual", "/inference_instruct2")
_ROUTES: dict[tuple[str, str], tuple[dict[str, Any], int]] = {
    ("POST", "/v1/audio/speech"): ({"json": {}}, 422),
    ("GET", "/v1/models"): ({}, 200),
    ("GET", "/tts"): ({}, 422),
    ("GET", "/v1/audio/voices"): ({}, 200),
    ("POST", "/v1/audio/voices"): ({"data": {"name": "x"}}, 400),
    ("DELETE", "/v1/audio/voices/{name}"): ({}, 404),
    ("GET", "/inference_instruct"): ({}, 400),
    ("POST", "/inference_instruct"): ({}, 400),
    ("GET", "/openapi.json"): ({}, 200),
    ("GET", "/docs"): ({}, 200),
    ("GET", "/docs/oauth2-redirect"): ({}, 200),
    ("GET", "/redoc"): ({}, 200),
    ("GET", "/metrics"): ({}, 200),
    **{(m, p): ({}, 400) for p in _UPSTREAM for m in ("GET", "POST")},
}
# Voice changes need a voice admin (auth_voice_admins = "svc": the API key's identity).
_ADMIN_ONLY = {("POST", "/v1/audio/voices"), ("DELETE", "/v1/audio/voices/{name}")}
_OPEN = {("GET", "/health"): 200, ("GET", "/ready"): 200}


def _http_routes() -> list[tuple[str, str]]:
    """Every HTTP route of the app: the documented API, and the documentation's own."""
    app = create_app(Settings.load(auth_mode="none"))
    with warnings.catch_warnings():  # upstream's GET+POST routes share operation ids
        warnings.simplefilter("ignore", UserWarning)
        paths = app.openapi()["paths"]
    routes = {(m.upper(), p) for p, ops in paths.items() for m in ops}
    for route in app.routes:
        methods = getattr(route, "methods", None) or ()
        routes |= {(m, getattr(route, "path", "")) for m in methods if m != "HEAD"}
    return sorted(routes)


def test_every_http_route_by_credential(auth_server: AuthServer) -> None:
    results: dict[tuple[str, str, str], int] = {}
    with httpx.Client(base_url=auth_server.url, timeout=30) as client:
        for method, path in _http_routes():
            if (method, path) in _OPEN:
                request, valid, protected = {}, _OPEN[(method, path)], False
            else:
                assert (method, path) in _ROUTES, f"{method} {path}: add it to the auth matrix"
                (request, valid), protected = _ROUTES[(method, path)], True
            url = path.replace("{name}", "no_such_voice")
            for kind, headers in _credentials(auth_server).items():
                response = client.request(method, url, headers=headers, **request)
                results[(method, path, kind)] = response.status_code
                expected = valid if kind.startswith("valid") or not protected else 401
                if (method, path) in _ADMIN_ONLY and kind.startswith("valid") and kind != "valid key":
                    expected = 403
                assert response.status_code == expected, (method, path, kind, response.text[:200])
                if expected == 401:
                    assert response.headers["WWW-Authenticate"].startswith("Bearer")
                    assert response.json()["error"]["code"] == "unauthorized"
    assert len({k[:2] for k in results}) >= 18


def test_voice_changes_need_a_voice_admin(auth_server: AuthServer) -> None:
    creds = _credentials(auth_server)
    response = httpx.delete(f"{auth_server.url}/v1/audio/voices/x", headers=creds["valid basic"], timeout=30)
    assert response.status_code == 403 and response.json()["error"]["code"] == "forbidden"
    response = httpx.delete(f"{auth_server.url}/v1/audio/voices/x", headers=creds["valid key"], timeout=30)
    assert response.status_code == 404


def test_websocket_handshake(auth_server: AuthServer) -> None:
    ws_url = auth_server.url.replace("http://", "ws://") + "/v1/audio/speech/ws"
    creds = _credentials(auth_server)
    for kind in ("none", "wrong key", "expired token"):
        with pytest.raises(InvalidStatus) as info:
            connect(ws_url, additional_headers=creds[kind], open_timeout=10).close()
        assert info.value.response.status_code == 401
    for kind in ("valid key", "valid token", "valid basic", "valid gateway"):
        with connect(ws_url, additional_headers=creds[kind], open_timeout=10) as ws:
            ws.send(json.dumps({"type": "config", "voice": BUILTIN}))
            assert '"ready"' in str(ws.recv(timeout=30))


def _speech(url: str, headers: dict[str, str], text: str = "你好。", **extra: Any) -> httpx.Response:
    body = {"model": "tts-1", "input": text, "voice": BUILTIN, "response_format": "pcm"}
    body |= {"min_tokens": TOKENS, "max_tokens": TOKENS, "seed": 1, **extra}
    return httpx.post(f"{url}/v1/audio/speech", json=body, headers=headers, timeout=120)


def test_grpc_calls_by_credential(auth_server: AuthServer) -> None:
    creds = _credentials(auth_server)
    with grpc.insecure_channel(auth_server.grpc_target) as channel:
        stub = cosyserve_v1_pb2_grpc.SpeechStub(channel)
        for kind, headers in creds.items():
            metadata = tuple((k.lower(), v) for k, v in headers.items())
            call = stub.ListVoices.with_call
            if kind.startswith("valid"):
                reply, _ = call(cosyserve_v1_pb2.ListVoicesRequest(), metadata=metadata, timeout=30)
                assert BUILTIN in [v.name for v in reply.voices]
            else:
                with pytest.raises(grpc.RpcError) as info:
                    call(cosyserve_v1_pb2.ListVoicesRequest(), metadata=metadata, timeout=30)
                assert info.value.code() is grpc.StatusCode.UNAUTHENTICATED, kind
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Synthesize(cosyserve_v1_pb2.SynthesizeRequest(text="hi", voice=BUILTIN), timeout=30))
        assert info.value.code() is grpc.StatusCode.UNAUTHENTICATED
        erin = (("authorization", creds["valid basic"]["Authorization"]),)
        with pytest.raises(grpc.RpcError) as info:
            stub.DeleteVoice(cosyserve_v1_pb2.DeleteVoiceRequest(name="x"), metadata=erin, timeout=30)
        assert info.value.code() is grpc.StatusCode.PERMISSION_DENIED
        token = (("authorization", creds["valid token"]["Authorization"]),)
        request = cosyserve_v1_pb2.SynthesizeRequest(
            text="你好。", voice=BUILTIN, min_tokens=10, max_tokens=10
        )
        audio = b"".join(r.audio for r in stub.Synthesize(request, metadata=token, timeout=60))
        assert len(audio) > 0


def test_audio_seconds_per_identity(auth_server: AuthServer) -> None:
    """1 s of audio a minute: a 2.4 s synthesis passes (into debt), the next one of that
    identity gets 429 with Retry-After on HTTP and RESOURCE_EXHAUSTED on gRPC; another
    identity is not affected."""
    heavy = {GATEWAY_HEADER: "heavy-user"}
    first = _speech(auth_server.url, heavy)
    assert first.status_code == 200 and len(first.content) == TOKENS * 960 * 2
    second = _speech(auth_server.url, heavy)
    assert second.status_code == 429 and second.json()["error"]["code"] == "rate_limited"
    # 2.4 s made against 1 s a minute: 1.4 s of debt, paid back at 1 s a minute.
    assert abs(int(second.headers["Retry-After"]) - (TOKENS / 25 - 1.0) * 60) <= 5
    with grpc.insecure_channel(auth_server.grpc_target) as channel:
        stub = cosyserve_v1_pb2_grpc.SpeechStub(channel)
        request = cosyserve_v1_pb2.SynthesizeRequest(text="hi", voice=BUILTIN, min_tokens=5, max_tokens=5)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Synthesize(request, metadata=((GATEWAY_HEADER.lower(), "heavy-user"),), timeout=30))
        assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert dict(info.value.trailing_metadata() or ())["retry-after"].isdigit()  # type: ignore[attr-defined]
    assert (
        _speech(auth_server.url, {GATEWAY_HEADER: "light-user"}, max_tokens=5, min_tokens=5).status_code
        == 200
    )


def test_guard_and_sighup_reload(auth_server: AuthServer) -> None:
    headers = {GATEWAY_HEADER: "guarded-user"}
    blocked = _speech(auth_server.url, headers, text=f"say the {BLOCKED.upper()} now", max_tokens=5)
    assert blocked.status_code == 400 and blocked.json()["error"]["code"] == "blocked_content"
    assert BLOCKED not in blocked.text.lower()
    control = _speech(auth_server.url, headers, text="bell\x07", max_tokens=5)
    assert control.status_code == 400 and control.json()["error"]["code"] == "invalid_characters"
    tts = httpx.get(
        f"{auth_server.url}/tts",
        params={"text": f"a {BLOCKED}", "voice": BUILTIN},
        headers=headers,
        timeout=30,
    )
    assert tts.status_code == 400
    auth_server.words.write_text(f"{BLOCKED}\nnewword\n")
    auth_server.server.process.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 20
    while _speech(auth_server.url, headers, text="a newword", max_tokens=5, min_tokens=5).status_code != 400:
        assert time.monotonic() < deadline, "the word list was not reloaded"
        time.sleep(0.2)
    assert auth_server.server.process.poll() is None  # SIGHUP did not stop the server
    assert BLOCKED not in auth_server.server.log().lower()  # neither text nor words are logged


def test_prompt_audio_duration_limit(auth_server: AuthServer) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}  # the voice admin

    def register(name: str, seconds: float) -> httpx.Response:
        files = {"audio": ("prompt.wav", prompt_wav(seconds), "audio/wav")}
        data = {"name": name, "transcript": PROMPT_TEXT}
        return httpx.post(
            f"{auth_server.url}/v1/audio/voices", data=data, files=files, headers=headers, timeout=60
        )

    too_long = register("long_voice", 3.0)
    assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "invalid_prompt_audio"
    assert register("short_voice", 1.5).status_code == 201
    blocked = httpx.post(
        f"{auth_server.url}/v1/audio/voices",
        data={"name": "blocked_voice", "transcript": f"the {BLOCKED}"},
        files={"audio": ("prompt.wav", prompt_wav(1.5), "audio/wav")},
        headers=headers,
        timeout=60,
    )
    assert blocked.status_code == 400 and blocked.json()["error"]["code"] == "blocked_content"
