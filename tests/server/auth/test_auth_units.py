"""Units of access control and the input guard: hashing, each method, the authenticator,
token buckets, the word filter and the guard."""

import asyncio
import base64
import random
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from cosyserve.server.auth.access import AccessControl
from cosyserve.server.auth.authenticator import Authenticator
from cosyserve.server.auth.basic import BasicUsers, parse_basic
from cosyserve.server.auth.gateway import Gateway
from cosyserve.server.auth.identity import AuthenticationError, Credentials, Identity, RateLimitedError
from cosyserve.server.auth.jwt import JwksCache, JwtVerifier
from cosyserve.server.auth.keys import ApiKeys, HashedSecret, hash_secret, parse_entries
from cosyserve.server.auth.ratelimit import RateLimiter
from cosyserve.server.error_map import map_error
from cosyserve.server.guard import BlockedContentError, ControlCharacterError, InputGuard
from cosyserve.server.service import SpeechParams
from cosyserve.server.settings import Settings, SettingsError
from cosyserve.server.wordfilter import WordFilter
from tests.server.auth.jwt_helpers import AUDIENCE, ISSUER, jwks, new_key

FAST = 10  # log2 n of test hashes: ~1 ms instead of ~40


def entry(name: str, secret: str) -> str:
    return f"{name}:{hash_secret(secret, log2_n=FAST)}"


def test_hash_round_trip_and_salt() -> None:
    a, b = hash_secret("s3cret", log2_n=FAST), hash_secret("s3cret", log2_n=FAST)
    assert a != b  # per-entry salt
    assert HashedSecret.parse(a).matches("s3cret") and HashedSecret.parse(b).matches("s3cret")
    assert not HashedSecret.parse(a).matches("s3cret ")
    with pytest.raises(ValueError):
        HashedSecret.parse("sha256$abc")


def test_entries_parse_and_name_errors_without_secrets() -> None:
    text = f"# comment\n{entry('a', 'k1')},{entry('b', 'k2')}\n"
    assert [n for n, _ in parse_entries(text, "auth_api_keys")] == ["a", "b"]
    with pytest.raises(SettingsError, match="entry 1") as info:
        parse_entries("a:plaintext-key", "auth_api_keys")
    assert "plaintext-key" not in str(info.value)
    with pytest.raises(SettingsError, match="twice"):
        parse_entries(f"{entry('a', 'x')},{entry('a', 'y')}", "auth_api_keys")


def test_api_keys_verify_and_cache() -> None:
    keys = ApiKeys(parse_entries(f"{entry('a', 'key-a')},{entry('b', 'key-b')}", "k"))
    assert keys.verify("key-b") == "b"
    assert keys.verify("key-b") == "b"  # from the cache
    assert keys.verify("key-c") is None and keys.verify("") is None


def test_basic_users() -> None:
    users = BasicUsers(parse_entries(entry("carol", "pw"), "u"))
    assert users.verify("carol", "pw") == "carol"
    assert users.verify("carol", "wrong") is None and users.verify("mallory", "pw") is None
    assert parse_basic(base64.b64encode(b"carol:p:w").decode()) == ("carol", "p:w")
    assert parse_basic("!!!") is None and parse_basic(base64.b64encode(b"nocolon").decode()) is None


def test_gateway_trusts_only_its_networks() -> None:
    gateway = Gateway("X-User", ["10.0.0.0/8", "::1"])
    assert gateway.identity("dave", "10.1.2.3") == "dave"
    assert gateway.identity("dave", "::ffff:10.1.2.3") == "dave"
    assert gateway.identity("dave", "192.168.0.1") is None
    assert gateway.identity("dave", None) is None and gateway.identity("\x00", "::1") is None
    with pytest.raises(SettingsError):
        Gateway("X-User", ["not-an-address"])


def test_jwt_from_file_checks_signature_claims_and_expiry(tmp_path: Path) -> None:
    key, other = new_key("k1"), new_key("k2")
    path = tmp_path / "jwks.json"
    path.write_text(jwks(key))
    verifier = JwtVerifier(JwksCache(str(path), 300), ISSUER, AUDIENCE, ["RS256"])
    assert verifier.verify(key.token("alice")) == "alice"
    bad = [
        key.token(expires_in=-3600),
        key.token(aud="someone-else"),
        key.token(iss="https://evil.test"),
        other.token(),  # unknown kid
        new_key("k1").token(),  # right kid, wrong key: the signature fails
        key.token()[:-4] + "AAAA",
        "a.b.c",
    ]
    for token in bad:
        with pytest.raises(AuthenticationError):
            verifier.verify(token)


def test_jwks_url_is_cached_and_refetched_for_a_new_key() -> None:
    key, rotated = new_key("old"), new_key("new")
    served = {"body": jwks(key), "hits": 0}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            served["hits"] = int(served["hits"]) + 1
            body = str(served["body"]).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    now = [1000.0]
    with _http_server(Handler) as url:
        cache = JwksCache(url, refresh_s=300, clock=lambda: now[0])
        verifier = JwtVerifier(cache, ISSUER, AUDIENCE, ["RS256"])
        for _ in range(3):
            assert verifier.verify(key.token("u")) == "u"
        assert served["hits"] == 1  # cached
        served["body"] = jwks(key, rotated)
        now[0] += 11  # past the minimum refetch interval
        assert verifier.verify(rotated.token("v")) == "v"  # unknown kid -> refetch
        assert served["hits"] == 2
        now[0] += 301
        verifier.verify(key.token("u"))
        assert served["hits"] == 3  # stale -> refetch


class _http_server:
    """A loopback HTTP server in a thread, shut down on exit."""

    def __init__(self, handler: type[BaseHTTPRequestHandler]) -> None:
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        return f"http://127.0.0.1:{self.server.server_address[1]}/jwks.json"

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


def test_authenticator_combines_methods_and_hides_which_failed(tmp_path: Path) -> None:
    key = new_key("k")
    (tmp_path / "jwks.json").write_text(jwks(key))
    settings = Settings.load(
        auth_api_keys=entry("svc", "the-key"),
        auth_basic_users=entry("erin", "pw"),
        auth_jwks=str(tmp_path / "jwks.json"),
        auth_jwt_issuer=ISSUER,
        auth_jwt_audience=AUDIENCE,
        auth_gateway_header="X-User",
        auth_gateway_trusted="10.0.0.1",
    )
    auth = Authenticator.from_settings(settings)

    def run(authorization: str | None, gateway: str | None = None, peer: str = "127.0.0.1") -> Identity:
        return asyncio.run(auth.authenticate(Credentials(authorization, gateway, peer)))

    assert run("Bearer the-key") == Identity("svc", "api_key")
    assert run("bearer " + key.token("zoe")) == Identity("zoe", "jwt")
    assert run("Basic " + base64.b64encode(b"erin:pw").decode()) == Identity("erin", "basic")
    assert run(None, "gw-user", "10.0.0.1") == Identity("gw-user", "gateway")
    messages = set()
    for bad in ("Bearer wrong", "Basic " + base64.b64encode(b"erin:no").decode(), "Token x", "Bearer a.b.c"):
        with pytest.raises(AuthenticationError) as info:
            run(bad)
        messages.add(str(info.value))
    assert messages <= {"invalid credentials", "invalid or expired token"}
    with pytest.raises(AuthenticationError, match="required"):
        run(None, "gw-user", "10.0.0.2")  # header from an untrusted peer is ignored


def test_auth_on_without_a_method_is_a_settings_error() -> None:
    with pytest.raises(SettingsError, match="auth_mode"):
        Authenticator.from_settings(Settings.load())
    off = Authenticator.from_settings(Settings.load(auth_mode="none"))
    identity = asyncio.run(off.authenticate(Credentials(None, None, "10.9.8.7")))
    assert identity == Identity("anonymous@10.9.8.7", "none")


def test_request_bucket_refills_and_tells_when_to_retry() -> None:
    now = [0.0]
    limiter = RateLimiter(requests_per_min=3, audio_s_per_min=0, clock=lambda: now[0])
    alice, bob = Identity("alice", "api_key"), Identity("bob", "api_key")
    for _ in range(3):
        limiter.take_request(alice)
    with pytest.raises(RateLimitedError) as info:
        limiter.take_request(alice)
    assert info.value.retry_after_s == 20  # one token per 20 s
    mapped = map_error(info.value)
    assert (mapped.http_status, mapped.http_headers()) == (429, {"Retry-After": "20"})
    limiter.take_request(bob)  # per identity
    now[0] += 20
    limiter.take_request(alice)
    with pytest.raises(RateLimitedError):
        limiter.take_request(alice)


def test_audio_bucket_allows_a_debt_then_waits() -> None:
    now = [0.0]
    limiter = RateLimiter(requests_per_min=0, audio_s_per_min=60, clock=lambda: now[0])
    carol = Identity("carol", "basic")
    limiter.check_audio(carol)
    limiter.charge_audio(carol, 90)  # one long synthesis: 30 s in debt
    with pytest.raises(RateLimitedError) as info:
        limiter.check_audio(carol)
    assert info.value.retry_after_s == 31
    now[0] += 31
    limiter.check_audio(carol)


def test_word_filter_matches_like_naive_search() -> None:
    rng = random.Random(0)
    alphabet = "abcAB敏感词"
    for _ in range(200):
        words = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(5)]
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        found = {(m.start, m.end) for m in WordFilter(words).find(text)}
        folded, lowered = text.lower(), [w.lower() for w in words]
        naive = {(i, i + len(w)) for w in lowered for i in range(len(text)) if folded.startswith(w, i)}
        assert found == naive
    assert WordFilter(["bad", "敏感"]).mask("a BAD 敏感词") == "a *** **词"


def test_guard_rejects_control_characters_and_blocks_or_masks(tmp_path: Path) -> None:
    words = tmp_path / "words.txt"
    words.write_text("# list\nsecret plan\n敏感\n")
    reject = InputGuard(str(words), "reject")
    assert reject.check_text("line one\nline\ttwo", "text") == "line one\nline\ttwo"
    with pytest.raises(ControlCharacterError):
        reject.check_text("bell\x07", "text")
    with pytest.raises(BlockedContentError) as info:
        reject.check_params(SpeechParams(text="the SECRET PLAN is"))
    assert map_error(info.value).http_status == 400 and "SECRET" not in str(info.value)
    mask = InputGuard(str(words), "mask")
    masked = mask.check_params(SpeechParams(text="a 敏感 text", instruct="no secret plan"))
    assert (masked.text, masked.instruct) == ("a ** text", "no ***********")
    words.write_text("text\n")
    assert mask.reload() and mask.check_text("a 敏感 text", "text") == "a 敏感 ****"
    words.unlink()
    assert not mask.reload() and mask.word_count == 1  # a failed reload keeps the old list
    with pytest.raises(SettingsError):
        InputGuard(str(words))


def test_failed_authentications_are_throttled_per_address() -> None:
    settings = Settings.load(auth_api_keys=entry("svc", "good"), auth_failures_per_min=2)
    access = AccessControl.from_settings(settings)

    def admit(key: str, peer: str) -> str:
        meter = asyncio.run(access.admit(Credentials(f"Bearer {key}", None, peer)))
        return meter.identity.name

    for _ in range(2):
        with pytest.raises(AuthenticationError):
            admit("bad", "10.0.0.5")
    with pytest.raises(RateLimitedError) as info:
        admit("good", "10.0.0.5")  # refused before the key is checked
    assert info.value.retry_after_s == 30
    assert admit("good", "10.0.0.6") == "svc"  # another address is not affected


def test_cli_hash_key_prints_a_key_and_its_entry() -> None:
    from typer.testing import CliRunner

    from cosyserve.cli.main import app

    made = CliRunner().invoke(app, ["auth", "hash-key", "svc"])
    assert made.exit_code == 0, made.output
    lines = dict(line.split(":", 1) for line in made.output.splitlines())
    key = lines["key"].strip()
    keys = ApiKeys(parse_entries(lines["entry"].strip(), "auth_api_keys"))
    assert keys.verify(key) == "svc" and keys.verify(key + "x") is None
    piped = CliRunner().invoke(app, ["auth", "hash-key", "erin", "--stdin"], input="pw\n")
    name, _, encoded = piped.output.removeprefix("entry: ").strip().partition(":")
    assert name == "erin" and HashedSecret.parse(encoded).matches("pw")
    bad = CliRunner().invoke(app, ["auth", "hash-key", "a:b"])
    assert bad.exit_code == 2
