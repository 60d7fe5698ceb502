"""GET /metrics: Prometheus text format, request and engine metrics."""

import httpx
from prometheus_client.parser import text_string_to_metric_families

from cosyserve.server.observability.metrics import ServerMetrics
from tests.server.conftest import ServerProcess

VOICE = "英文男"


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_request_metrics_are_recorded_per_route_and_status() -> None:
    metrics = ServerMetrics()
    metrics.observe_request(route="/tts", status=200, total_s=0.5, first_audio_s=0.1, audio_s=2.0)
    metrics.observe_request(route="/tts", status=429, total_s=0.01, first_audio_s=None, audio_s=0.0)
    from prometheus_client import generate_latest

    samples = _samples(generate_latest(metrics.registry).decode())
    assert samples[("cosyserve_requests_total", (("route", "/tts"), ("status", "200")))] == 1
    assert samples[("cosyserve_requests_total", (("route", "/tts"), ("status", "429")))] == 1
    assert samples[("cosyserve_audio_seconds_total", (("route", "/tts"),))] == 2.0
    assert samples[("cosyserve_real_time_factor_sum", (("route", "/tts"),))] == 0.25
    assert samples[("cosyserve_time_to_first_audio_seconds_count", (("route", "/tts"),))] == 1
    assert samples[("cosyserve_request_duration_seconds_count", (("route", "/tts"),))] == 2
    assert ("cosyserve_engine_alive", ()) not in samples  # no service yet


def test_metrics_endpoint_after_a_request(server: ServerProcess) -> None:
    before = _samples(httpx.get(f"{server.url}/metrics").text)
    key = ("cosyserve_requests_total", (("route", "/tts"), ("status", "200")))
    response = httpx.get(
        f"{server.url}/tts",
        params={"text": "Hi.", "voice": VOICE, "min_tokens": 10, "max_tokens": 10, "seed": 1},
        timeout=120,
    )
    assert response.status_code == 200, response.text
    scrape = httpx.get(f"{server.url}/metrics")
    assert scrape.status_code == 200 and scrape.headers["content-type"].startswith("text/plain")
    after = _samples(scrape.text)
    assert after[key] == before.get(key, 0) + 1
    assert after[("cosyserve_audio_seconds_total", (("route", "/tts"),))] > 0
    assert after[("cosyserve_engine_alive", ())] == 1
    assert after[("cosyserve_lm_decoded_tokens_total", ())] >= 10
    assert after[("cosyserve_flow_calls_total", ())] >= 1
    assert after[("cosyserve_flow_chunks_total", ())] >= after[("cosyserve_flow_calls_total", ())]
    assert after[("cosyserve_hift_chunks_total", ())] >= after[("cosyserve_hift_calls_total", ())] >= 1
    assert after[("cosyserve_flow_cache_refusals_total", ())] == 0  # no budget set
    assert after[("process_resident_memory_bytes", ())] > 0
    for name in ("cosyserve_queue_depth", "cosyserve_active_streams", "cosyserve_lm_batch_size"):
        assert (name, ()) in after
