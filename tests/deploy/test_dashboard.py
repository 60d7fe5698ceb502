"""The Grafana dashboard and the prometheus-adapter rule ask only for metrics the server
exports: every PromQL expression is parsed (promql-parser) and each series it selects is
looked up among the samples a real server's registry can produce, after one request.

Families that have no sample after one request (the engine's error counter before any
failure) are checked by name and type only.
"""

import json
import time
from collections.abc import Iterator
from pathlib import Path

import promql_parser
import pytest
import yaml
from fastapi.testclient import TestClient
from prometheus_client.core import Metric

from cosyserve.server.http.app import create_app
from cosyserve.server.settings import Settings
from tests.deploy.tooling import ROOT
from tests.server.conftest import START_TIMEOUT_S

DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "cosyserve.json"
ADAPTER = ROOT / "deploy" / "k8s" / "components" / "queue-hpa" / "prometheus-adapter.yaml"
HPA_PATCH = ROOT / "deploy" / "k8s" / "components" / "queue-hpa" / "hpa-queue-depth.yaml"
# Labels Prometheus attaches to every scraped series (static configs and Kubernetes pods).
TARGET_LABELS = {"job", "instance", "namespace", "pod"}
# Grafana's variables, as a query would be sent.
VARIABLES = {"$__rate_interval": "1m", "$job": "cosyserve"}
# The sample names each family type produces in the text format.
SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "info": ("_info",),
}


@pytest.fixture(scope="module")
def families(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Metric]]:
    """The metric families of a started server (tiny model) after one /tts request."""
    tmp = tmp_path_factory.mktemp("dashboard")
    settings = Settings.load(
        model_dir=tiny_model_dir,
        auth_mode="none",
        grpc_port=0,
        voices_db=tmp / "voices.sqlite3",
        profile="exact",
    )
    app = create_app(settings)
    with TestClient(app) as client:
        deadline = time.monotonic() + START_TIMEOUT_S
        while client.get("/ready").status_code != 200:
            assert time.monotonic() < deadline, client.get("/ready").json()
            time.sleep(0.1)
        response = client.get(
            "/tts", params={"text": "Hi.", "voice": "英文男", "min_tokens": 10, "max_tokens": 10, "seed": 1}
        )
        assert response.status_code == 200, response.text
        yield list(app.state.metrics.registry.collect())


@pytest.fixture(scope="module")
def exported(families: list[Metric]) -> dict[str, set[str]]:
    """Every sample name the server can export -> the label names seen on it."""
    names: dict[str, set[str]] = {}
    for family in families:
        for suffix in SUFFIXES[family.type]:
            names.setdefault(family.name + suffix, set())
        for sample in family.samples:
            names.setdefault(sample.name, set()).update(sample.labels)
    return names


def _selectors(expr: str) -> list[tuple[str, set[str]]]:
    """(metric name, label names it is grouped by above it) for each series an expression reads."""
    for variable, value in VARIABLES.items():
        expr = expr.replace(variable, value)
    found: list[tuple[str, set[str]]] = []
    grouping: list[set[str]] = []

    def by(node: object) -> bool:
        modifier = getattr(node, "modifier", None)
        return (
            isinstance(node, promql_parser.AggregateExpr)
            and modifier is not None
            and (modifier.type == promql_parser.AggModifierType.By)
        )

    def pre(node: object) -> None:
        if by(node):
            grouping.append(set(node.modifier.labels))  # type: ignore[attr-defined]
        if isinstance(node, promql_parser.VectorSelector):
            assert node.name, f"a selector without a metric name in {expr}"
            found.append((node.name, set().union(*grouping) if grouping else set()))

    def post(node: object) -> None:
        if by(node):
            grouping.pop()

    promql_parser.walk(promql_parser.parse(expr), pre, post)
    return found


def _dashboard_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    for variable in dashboard["templating"]["list"]:
        # label_values(METRIC, LABEL): the metric must exist and carry the label.
        inner = variable["query"]["query"].removeprefix("label_values(").removesuffix(")")
        metric, label = (part.strip() for part in inner.split(","))
        queries.append(f"count by ({label}) ({metric})")
    return queries


def _check(expr: str, exported: dict[str, set[str]]) -> None:
    selectors = _selectors(expr)
    assert selectors, expr
    for name, grouped_by in selectors:
        assert name in exported, f"{name} (in {expr}) is not exported by the server"
        labels = exported[name]
        if not labels:
            continue  # no sample yet: name and type only
        allowed = labels | TARGET_LABELS | ({"le"} if name.endswith("_bucket") else set())
        assert grouped_by <= allowed, f"{expr}: {name} has no label {grouped_by - allowed}"


def test_the_selector_extraction_sees_through_functions_and_aggregations() -> None:
    found = _selectors(
        'histogram_quantile(0.95, sum by (le) (rate(a_bucket{job=~"$job"}[$__rate_interval]))) / b'
    )
    assert found == [("a_bucket", {"le"}), ("b", set())]


def test_a_misspelt_metric_is_caught(exported: dict[str, set[str]]) -> None:
    with pytest.raises(AssertionError, match="cosyserve_queue_dept "):
        _check("sum(cosyserve_queue_dept)", exported)
    with pytest.raises(AssertionError, match="has no label"):
        _check("sum by (voice) (rate(cosyserve_requests_total[1m]))", exported)


@pytest.mark.parametrize("expr", _dashboard_queries())
def test_dashboard_query_reads_exported_metrics(expr: str, exported: dict[str, set[str]]) -> None:
    _check(expr, exported)


def test_dashboard_shows_what_operators_need() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    read = {
        name for panel in dashboard["panels"] for t in panel["targets"] for name, _ in _selectors(t["expr"])
    }
    assert {
        "cosyserve_time_to_first_audio_seconds_bucket",
        "cosyserve_real_time_factor_bucket",
        "cosyserve_requests_total",
        "cosyserve_queue_depth",
        "cosyserve_active_streams",
        "cosyserve_lm_decoded_tokens_total",
        "process_resident_memory_bytes",
        "cosyserve_engine_errors_total",
    } <= read
    titles = [panel["title"] for panel in dashboard["panels"]]
    assert len(titles) == len(set(titles))


def test_prometheus_adapter_rule_serves_an_exported_metric_to_the_hpa(exported: dict[str, set[str]]) -> None:
    config = yaml.safe_load(yaml.safe_load(ADAPTER.read_text())["data"]["config.yaml"])
    (rule,) = config["rules"]
    (series,) = _selectors(rule["seriesQuery"])
    assert series[0] in exported
    served = rule["name"]["as"]
    (patch,) = yaml.safe_load(HPA_PATCH.read_text())
    assert patch["value"]["pods"]["metric"]["name"] == served
    # The adapter's query template, filled as the adapter fills it, is valid PromQL.
    query = rule["metricsQuery"].replace("<<.Series>>", series[0])
    query = query.replace("<<.LabelMatchers>>", 'namespace="default"').replace("<<.GroupBy>>", "pod")
    _check(query, exported)
