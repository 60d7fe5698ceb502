"""The Ray Serve application on a local two-node Ray cluster (a head and a second node
process on this machine), the tiny model and a throwaway PostgreSQL voice store: both
replicas serve the whole HTTP API, a voice registered through one replica speaks on the
other, a replica killed under load is replaced while the other keeps answering, and the
autoscaler goes from 1 replica to 2 under load and back. One cluster for the module; its
every process is stopped at the end, also after a failure.

The replica health check itself runs here without a Ray cluster too (the first test, in the
default run).
"""

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("ray.serve", reason="Ray Serve is the `ray` extra: pip install -e '.[ray]'")

import ray
from ray import serve
from ray.cluster_utils import Cluster
from ray.serve.schema import ApplicationStatus

from cosyserve.deploy.ray import DEPLOYMENT_NAME, ReplicaNotReadyError, SpeechReplica, build_app
from cosyserve.deploy.replica_header import NODE_HEADER, REPLICA_HEADER
from cosyserve.server.runtime import Phase, ServerRuntime
from cosyserve.server.settings import Settings
from tests.server.http_audio import BUILTIN, PROMPT_TEXT, assert_speechlike_pcm, prompt_wav
from tests.server.test_grpc import free_port
from tests.server.test_voices import register
from tests.server.test_ws import audio_of, send, session, until

APP = "cosyserve"
AUTOSCALED_APP = "autoscaled"
TEXT = "Hi."  # short: the tiny model's random weights speak up to 20 tokens per text token
DEPLOY_TIMEOUT_S = 300.0
REPLACE_TIMEOUT_S = 180.0
SCALE_TIMEOUT_S = 180.0

# -- the health check, without a cluster ---------------------------------------------------


def test_health_check_fails_until_the_engine_can_synthesise(tmp_path: Path) -> None:
    # Not through __init__: that configures the process's torch threads and logging, which
    # belong to a replica's process, not to the test run's.
    replica = SpeechReplica.__new__(SpeechReplica)
    replica._runtime = None
    with pytest.raises(ReplicaNotReadyError, match="phase not built"):
        replica.check_health()
    runtime = ServerRuntime(Settings(model_dir=tmp_path, auth_mode="none"))
    replica._runtime = runtime
    for phase in (Phase.STARTING, Phase.FAILED, Phase.READY):  # READY, but no engine thread
        runtime.phase = phase
        with pytest.raises(ReplicaNotReadyError, match=f"phase {phase.value}, engine alive: False"):
            replica.check_health()


# -- the cluster --------------------------------------------------------------------------


@dataclass(frozen=True)
class Serving:
    """An application's base URL (``url``, as the WebSocket helpers take it)."""

    url: str
    name: str


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    """A Ray head and a second node, 2 logical CPUs each (a replica takes 1, and at most one
    replica of an application runs on a node), with Serve's HTTP proxy on a free port of
    the head only; yields the proxy's base URL. Every Ray file, socket and log is under a
    temporary directory of its own, which also names the cluster's processes: any still
    running after the shutdown are killed (``ray stop --force`` for this cluster only)."""
    temp = tempfile.mkdtemp(prefix="ray-")  # short: Ray's socket paths must fit 107 bytes
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_TMPDIR", temp)  # not /tmp/ray: no other cluster's files, nor theirs ours
        env.setenv("RAY_USAGE_STATS_ENABLED", "0")
        # The one proxy runs on the head; by default it prefers the replica on its own node
        # whenever that one has room, so the other node's replica would see no requests.
        env.setenv("RAY_SERVE_PROXY_PREFER_LOCAL_NODE_ROUTING", "0")
        # Replicas report their load every half second, so the autoscaler reacts in seconds.
        env.setenv("RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S", "0.5")
        env.setenv("RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S", "0.5")
        nodes = Cluster()
        try:
            nodes.add_node(num_cpus=2, include_dashboard=False)  # the first node is the head
            nodes.add_node(num_cpus=2)
            nodes.wait_for_nodes()
            ray.init(address=nodes.address, log_to_driver=False)
            port = free_port()
            serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
            yield f"http://127.0.0.1:{port}"
        finally:
            try:
                if ray.is_initialized():
                    serve.shutdown()
            finally:
                ray.shutdown()
                nodes.shutdown()
                left = wait_for_none(lambda: processes_of(temp), 30)
                for process in left:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(process.split(":", 1)[0]), signal.SIGKILL)
                shutil.rmtree(temp, ignore_errors=True)
    assert not left, f"Ray processes still running 30 s after the cluster's shutdown (killed): {left}"


def deploy(name: str, route_prefix: str, **args: str) -> None:
    """``build_app`` with ``args`` (strings, as ``serve run`` passes them) run as ``name``;
    returns once every replica is running (``serve.run`` waits; it raises if a replica
    fails to start)."""
    serve.run(build_app(args), name=name, route_prefix=route_prefix)
    assert status_of(name).status == ApplicationStatus.RUNNING


def base_args(model_dir: Path, voices_db: str) -> dict[str, str]:
    return {
        "model_dir": str(model_dir),
        "voices_db": voices_db,
        "auth_mode": "none",
        "profile": "exact",
        "num_cpus": "1",
        "max_replicas_per_node": "1",
        "health_check_period_s": "2",
        "shutdown_grace_s": "5",
    }


@pytest.fixture(scope="module")
def two_replicas(cluster: str, tiny_model_dir: Path, postgres_url: str) -> Iterator[Serving]:
    """The application with 2 fixed replicas, one on each node, sharing a PostgreSQL store,
    deployed as a user does: ``serve run cosyserve.deploy.ray:build_app KEY=VALUE ...``."""
    args = {"num_replicas": "2", **base_args(tiny_model_dir, postgres_url)}
    command = [str(Path(sys.executable).parent / "serve"), "run", "--non-blocking"]
    command += ["--address", ray.get_runtime_context().gcs_address, "--name", APP, "--route-prefix", "/"]
    command += ["cosyserve.deploy.ray:build_app", *(f"{key}={value}" for key, value in args.items())]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=DEPLOY_TIMEOUT_S)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
        wait_for(lambda: status_of(APP).status == ApplicationStatus.RUNNING, DEPLOY_TIMEOUT_S, "replicas")
        yield Serving(cluster, APP)
    finally:
        serve.delete(APP)


def status_of(name: str) -> Any:
    return serve.status().applications[name]


def running_replicas(name: str) -> int:
    states = status_of(name).deployments[DEPLOYMENT_NAME].replica_states
    return int(states.get("RUNNING", 0))


def replica_actors(name: str) -> dict[str, str]:
    """The app's live replica actors: replica id (as in ``x-cosyserve-replica``) -> actor name."""
    prefix = f"SERVE_REPLICA::{name}#{DEPLOYMENT_NAME}#"
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    return {n.removeprefix(prefix): n for n in names if n.startswith(prefix)}


def wait_for_none(found: Callable[[], list[str]], timeout_s: float) -> list[str]:
    """``found()`` once it is empty, or what it still finds after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while (left := found()) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def processes_of(temp: str) -> list[str]:
    """``pid: command line`` of the processes that name ``temp`` in their command line or
    environment (a Ray worker renames its command line, but inherits ``RAY_TMPDIR``)."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            raw = Path(f"/proc/{entry}/cmdline").read_bytes()
            environ = Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:  # it exited meanwhile
            continue
        if entry != str(os.getpid()) and (temp.encode() in raw or temp.encode() in environ):
            command = raw.replace(b"\0", b" ").decode(errors="replace")
            found.append(f"{entry}: {command[:160]}")
    return found


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Seconds until ``condition()`` holds; fails after ``timeout_s``."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout_s, f"no {what} after {timeout_s} s"
        time.sleep(0.25)
    return time.monotonic() - start


def speech(url: str, client: httpx.Client | None = None, **fields: Any) -> httpx.Response:
    body = {"model": "cosyvoice2", "input": TEXT, "voice": BUILTIN, "response_format": "pcm", **fields}
    if client is not None:
        return client.post(f"{url}/v1/audio/speech", json=body)
    return httpx.post(f"{url}/v1/audio/speech", json=body, timeout=60)


@dataclass(frozen=True)
class Outcome:
    """One request of a load: when it was sent and answered, by which replica (None: no
    audio), and the failure it got."""

    sent: float
    done: float
    replica: str | None
    failure: str = ""


class Load:
    """``clients`` threads each sending one request after another until stopped."""

    def __init__(self, url: str, clients: int) -> None:
        self.outcomes: list[Outcome] = []
        self._url = url
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, daemon=True) for _ in range(clients)]

    def __enter__(self) -> "Load":
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=120)
        assert not any(t.is_alive() for t in self._threads), "a load client did not stop"

    def replicas(self, after: float = 0.0) -> set[str]:
        return {o.replica for o in list(self.outcomes) if o.replica is not None and o.sent >= after}

    def _client(self) -> None:
        with httpx.Client(timeout=120) as client:
            while not self._stop.is_set():
                sent = time.monotonic()
                try:
                    response = speech(self._url, client)
                except httpx.TransportError as exc:
                    self.outcomes.append(Outcome(sent, time.monotonic(), None, f"transport: {exc!r}"))
                    continue
                done = time.monotonic()
                if response.status_code == 200:
                    try:
                        assert_speechlike_pcm(response.content)
                    except AssertionError as exc:
                        self.outcomes.append(Outcome(sent, done, None, f"200 but no speech: {exc}"))
                        continue
                    self.outcomes.append(Outcome(sent, done, response.headers[REPLICA_HEADER]))
                else:
                    kind = response.headers.get("content-type")
                    failure = f"{response.status_code} {kind}: {response.text}"
                    self.outcomes.append(Outcome(sent, done, None, failure))


@pytest.mark.slow
@pytest.mark.ray
def test_both_replicas_on_both_nodes_serve_the_whole_api(two_replicas: Serving) -> None:
    url = two_replicas.url
    assert httpx.get(f"{url}/ready", timeout=10).status_code == 200
    seen: dict[str, str] = {}
    for _ in range(40):  # Ray picks the less busy of two random replicas: both come up soon
        response = speech(url)
        assert response.status_code == 200, response.text
        assert_speechlike_pcm(response.content)
        seen[response.headers[REPLICA_HEADER]] = response.headers[NODE_HEADER]
        if len(seen) == 2:
            break
    assert len(seen) == 2, f"only replica(s) {sorted(seen)} answered"
    assert len(set(seen.values())) == 2, "both replicas run on one node"
    assert set(seen) == set(replica_actors(APP))

    # Streaming comes through Ray's proxy as it is made: several chunks of one response.
    with httpx.stream(
        "POST",
        f"{url}/v1/audio/speech",
        json={"model": "cosyvoice2", "input": "Hello there, how are you today?", "voice": BUILTIN,
              "response_format": "pcm", "stream": True, "seed": 3},
        timeout=60,
    ) as streamed:  # fmt: skip
        assert streamed.status_code == 200
        chunks = [chunk for chunk in streamed.iter_raw() if chunk]
    assert len(chunks) >= 2, f"{len(chunks)} chunk(s)"
    assert_speechlike_pcm(b"".join(chunks))
    # GET /tts, upstream's endpoint, the voice list and the WebSocket.
    tts = httpx.get(f"{url}/tts", params={"text": TEXT, "voice": BUILTIN}, timeout=60)
    assert tts.status_code == 200 and tts.headers["content-type"] == "audio/wav"
    sft = httpx.post(f"{url}/inference_sft", data={"tts_text": TEXT, "spk_id": BUILTIN}, timeout=60)
    assert sft.status_code == 200
    assert_speechlike_pcm(sft.content)
    voices = httpx.get(f"{url}/v1/audio/voices", timeout=10).json()["voices"]
    assert BUILTIN in {v["name"] for v in voices}
    with session(two_replicas, seed=1) as ws:  # type: ignore[arg-type]
        send(ws, "text", text="Hello there.")
        send(ws, "end")
        events = until(ws, lambda e: e["type"] == "done")
    assert not [e for e in events if e["type"] == "error"]
    assert_speechlike_pcm(audio_of(events))
    # A bad request gets the server's own 4xx through the proxy.
    bad = speech(url, input="   ")
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_request", bad.text


@pytest.mark.slow
@pytest.mark.ray
def test_a_voice_registered_through_one_replica_speaks_on_the_other(two_replicas: Serving) -> None:
    url = two_replicas.url
    name = f"ray_{uuid.uuid4().hex[:8]}"
    registered = register(url, name, prompt_wav(seconds=2.0), PROMPT_TEXT)
    assert registered.status_code == 201, registered.text
    owner = registered.headers[REPLICA_HEADER]
    try:
        for _ in range(40):
            response = speech(url, voice=name, seed=5)
            assert response.status_code == 200, response.text
            if response.headers[REPLICA_HEADER] != owner:
                break
        assert response.headers[REPLICA_HEADER] != owner, "the other replica never answered"
        assert_speechlike_pcm(response.content)
    finally:
        httpx.delete(f"{url}/v1/audio/voices/{name}", timeout=30)


@pytest.mark.slow
@pytest.mark.ray
def test_a_killed_replica_is_replaced_while_the_other_keeps_serving(two_replicas: Serving) -> None:
    url = two_replicas.url
    before = replica_actors(APP)
    assert len(before) == 2
    clients = 3
    with Load(url, clients) as load:
        wait_for(lambda: load.replicas() == set(before), 60, "answers from both replicas")
        victim, survivor = sorted(before)
        killed_at = time.monotonic()
        ray.kill(ray.get_actor(before[victim], namespace="serve"), no_restart=True)
        replaced_s = wait_for(
            lambda: running_replicas(APP) == 2 and len(set(replica_actors(APP)) - set(before)) == 1,
            REPLACE_TIMEOUT_S,
            "replacement replica",
        )
        (newcomer,) = set(replica_actors(APP)) - set(before)
        wait_for(lambda: newcomer in load.replicas(after=killed_at), 60, "answers from the new replica")
    outcomes = load.outcomes
    failed = [o for o in outcomes if o.failure]
    after_kill = [o for o in outcomes if o.sent > killed_at and o.replica is not None]
    print(
        f"replaced in {replaced_s:.1f} s; {len(outcomes)} requests, {len(failed)} failed "
        f"{sorted({o.failure[:80] for o in failed})}, "
        f"{len([o for o in after_kill if o.replica == survivor])} answered by the survivor meanwhile"
    )
    # Only requests that were on the killed replica failed: at most one per client, sent
    # before the kill and answered at once.
    assert len(failed) <= clients, [o.failure for o in failed]
    for outcome in failed:
        assert outcome.sent <= killed_at + 1.0, outcome
        assert outcome.failure.startswith("5"), outcome.failure  # a clean HTTP error, not a cut connection
        assert "Traceback" not in outcome.failure and 'File "' not in outcome.failure
    # The other replica kept answering while the new one started.
    assert any(o.replica == survivor and o.sent < killed_at + replaced_s for o in after_kill)
    assert victim not in {o.replica for o in after_kill}


@pytest.mark.slow
@pytest.mark.ray
def test_autoscaling_from_one_replica_to_two_under_load_and_back(
    cluster: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    deploy(
        AUTOSCALED_APP,
        f"/{AUTOSCALED_APP}",
        min_replicas="1",
        max_replicas="2",
        target_ongoing_requests="1",
        upscale_delay_s="1",
        downscale_delay_s="3",
        look_back_period_s="11",  # Ray wants more than its metrics_interval_s (10 s)
        **base_args(tiny_model_dir, str(tmp_path / "voices.sqlite3")),
    )
    url = f"{cluster}/{AUTOSCALED_APP}"
    try:
        assert running_replicas(AUTOSCALED_APP) == 1
        with Load(url, clients=4) as load:  # 4 in flight against a target of 1 per replica
            up_s = wait_for(lambda: running_replicas(AUTOSCALED_APP) == 2, SCALE_TIMEOUT_S, "second replica")
            wait_for(lambda: len(load.replicas()) == 2, 60, "answers from both replicas")
        assert not [o.failure for o in load.outcomes if o.failure]
        down_s = wait_for(lambda: running_replicas(AUTOSCALED_APP) == 1, SCALE_TIMEOUT_S, "scale-down")
        print(f"1 -> 2 replicas after {up_s:.1f} s of load; back to 1 {down_s:.1f} s after it")
        assert speech(url).status_code == 200
    finally:
        serve.delete(AUTOSCALED_APP)
