"""The Kubernetes manifests: each overlay built by kustomize (kubectl's, from the dev
extra), every resource validated against the schemas of one Kubernetes version
(kubernetes-validate, strict), and what ties them together checked: selectors, the names
of generated ConfigMaps and Secrets, probes on the app's routes, the grace period against
the drain, the init container's fetch. The RayService's pod templates are validated as
PodTemplates; its Serve config is parsed and its arguments checked by cosyserve itself.
"""

import ast
import shlex
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from cosyserve.deploy.ray_args import plan_ray_app
from cosyserve.server.runner import _BACKSTOP_S
from cosyserve.server.settings import ENV_PREFIX, Settings
from tests.deploy.tooling import ROOT, served, venv_tool

# The Kubernetes release the manifests are written for (kubernetes-validate's schemas).
KUBERNETES_VERSION = "1.32"
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("cpu", "gpu", "queue-hpa")
# Kinds of operators the manifests use; no schema of Kubernetes covers them.
CUSTOM_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}
RAY_APP = "cosyserve.deploy.ray:build_app"

Resource = dict[str, Any]


def _build(overlay: str) -> list[Resource]:
    result = subprocess.run(
        [venv_tool("kubectl"), "kustomize", str(K8S / "overlays" / overlay)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@pytest.fixture(scope="module", params=OVERLAYS)
def built(request: pytest.FixtureRequest) -> tuple[str, list[Resource]]:
    return request.param, _build(request.param)


def _one(resources: list[Resource], kind: str) -> Resource:
    (found,) = [r for r in resources if r["kind"] == kind]
    return found


def _names(resources: list[Resource], kind: str) -> set[str]:
    return {r["metadata"]["name"] for r in resources if r["kind"] == kind}


def _validate(resource: Resource) -> None:
    try:
        kubernetes_validate.validate(resource, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        raise AssertionError(f"{resource['kind']} {resource['metadata'].get('name')}: {exc}") from None


def test_every_resource_is_valid_kubernetes(built: tuple[str, list[Resource]]) -> None:
    _, resources = built
    for resource in resources:
        if (resource["apiVersion"], resource["kind"]) in CUSTOM_KINDS:
            continue  # checked in test_queue_depth_scaling
        _validate(resource)


def test_validation_rejects_a_broken_manifest(built: tuple[str, list[Resource]]) -> None:
    """The validator sees these manifests' mistakes: a misspelt field, a wrong type."""
    deployment = _one(built[1], "Deployment")
    misspelt = yaml.safe_load(yaml.safe_dump(deployment))
    misspelt["spec"]["template"]["spec"]["terminationGracePeriod"] = 60
    with pytest.raises(AssertionError, match="terminationGracePeriod"):
        _validate(misspelt)
    wrong = yaml.safe_load(yaml.safe_dump(deployment))
    wrong["spec"]["replicas"] = "two"
    with pytest.raises(AssertionError):
        _validate(wrong)


def test_overlays_hold_the_expected_resources(built: tuple[str, list[Resource]]) -> None:
    overlay, resources = built
    kinds = {r["kind"] for r in resources}
    expected = {
        "Deployment",
        "Service",
        "HorizontalPodAutoscaler",
        "PodDisruptionBudget",
        "ConfigMap",
        "Secret",
    }
    if overlay == "queue-hpa":
        expected.add("ServiceMonitor")
    assert kinds == expected


def test_selectors_match_the_pods(built: tuple[str, list[Resource]]) -> None:
    _, resources = built
    deployment = _one(resources, "Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    selectors = [
        deployment["spec"]["selector"]["matchLabels"],
        _one(resources, "Service")["spec"]["selector"],
        _one(resources, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"],
    ]
    for selector in selectors:
        assert selector and selector.items() <= pod_labels.items(), selector
    target = _one(resources, "HorizontalPodAutoscaler")["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])


def _pod(resources: list[Resource]) -> Resource:
    spec: Resource = _one(resources, "Deployment")["spec"]["template"]["spec"]
    return spec


def _container(resources: list[Resource]) -> Resource:
    (container,) = _pod(resources)["containers"]
    return container


def _settings(resources: list[Resource]) -> dict[str, str]:
    """The COSYSERVE_* variables the server container gets: ConfigMap, then env."""
    container = _container(resources)
    configmaps = {r["metadata"]["name"]: r["data"] for r in resources if r["kind"] == "ConfigMap"}
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(configmaps[source["configMapRef"]["name"]])
    env.update({e["name"]: e["value"] for e in container["env"] if "value" in e})
    return {k: v for k, v in env.items() if k.startswith(ENV_PREFIX)}


def test_configuration_and_secrets_are_referenced_by_their_generated_names(
    built: tuple[str, list[Resource]],
) -> None:
    _, resources = built
    pod = _pod(resources)
    configmaps, secrets = _names(resources, "ConfigMap"), _names(resources, "Secret")
    for container in pod["containers"] + pod["initContainers"]:
        for source in container.get("envFrom", []):
            assert source["configMapRef"]["name"] in configmaps
    for volume in pod["volumes"]:
        if "secret" in volume:
            assert volume["secret"]["secretName"] in secrets
    settings = _settings(resources)
    Settings(**{name.removeprefix(ENV_PREFIX).lower(): value for name, value in settings.items()})
    # The API keys file is the mounted Secret's key.
    keys = Path(settings["COSYSERVE_AUTH_API_KEYS"].removeprefix("@"))
    mount = next(m for m in _container(resources)["volumeMounts"] if m["mountPath"] == str(keys.parent))
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    secret = next(r for r in resources if r["metadata"]["name"] == volume["secret"]["secretName"])
    assert keys.name in secret["data"]


def test_probes_use_the_apps_routes(built: tuple[str, list[Resource]]) -> None:
    container = _container(built[1])
    ports = {p["name"] for p in container["ports"]}
    expected = {"livenessProbe": "/health", "readinessProbe": "/ready", "startupProbe": "/ready"}
    for probe, path in expected.items():
        get = container[probe]["httpGet"]
        assert get["path"] == path and served(path) and get["port"] in ports


def test_grace_period_outlasts_the_drain(built: tuple[str, list[Resource]]) -> None:
    resources = built[1]
    settings = _settings(resources)
    grace = float(
        settings.get("COSYSERVE_SHUTDOWN_GRACE_S", Settings.model_fields["shutdown_grace_s"].default)
    )
    pre_stop = _container(resources)["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    assert _pod(resources)["terminationGracePeriodSeconds"] > float(pre_stop[1]) + grace + _BACKSTOP_S


def test_one_server_process_per_pod(built: tuple[str, list[Resource]]) -> None:
    """Replicas scale the server here; each pod's /metrics is then one process's."""
    assert _settings(built[1]).get("COSYSERVE_WORKERS", "1") == "1"


def _fetch_command(resources: list[Resource]) -> tuple[list[str], dict[str, str], set[str]]:
    """The init container's command, its environment and the volumes it writes."""
    (init,) = _pod(resources)["initContainers"]
    env = {e["name"]: e["value"] for e in init.get("env", [])}
    return init["command"], env, {m["name"] for m in init["volumeMounts"] if not m.get("readOnly")}


def test_init_container_fills_the_volume_the_server_reads(built: tuple[str, list[Resource]]) -> None:
    resources = built[1]
    command, env, written = _fetch_command(resources)
    container = _container(resources)
    model_dir = Path(_settings(resources)["COSYSERVE_MODEL_DIR"])
    assert Path(env["COSYSERVE_MODEL_DIR"]) == model_dir
    (mount,) = [m for m in container["volumeMounts"] if model_dir.is_relative_to(m["mountPath"])]
    assert mount["name"] in written and mount.get("readOnly") is True
    assert {e["name"]: e.get("value") for e in container["env"]}["FETCH_MODEL"] == "never"
    (init,) = _pod(resources)["initContainers"]
    assert init["image"] == container["image"]
    assert "cosyserve download --dir" in command[-1]


def _run_fetch(
    resources: list[Resource], model_dir: Path, tmp_path: Path
) -> subprocess.CompletedProcess[str]:
    command, _, _ = _fetch_command(resources)
    venv_bin = str(Path(venv_tool("cosyserve")).parent)
    env = {"PATH": f"{venv_bin}:/usr/bin:/bin", "HOME": str(tmp_path), "COSYSERVE_MODEL_DIR": str(model_dir)}
    env["HF_ENDPOINT"] = "http://127.0.0.1:9"  # nothing listens: a fetch fails at once
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)


def test_init_container_command_skips_a_filled_volume_and_fetches_an_empty_one(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The init container's shell command, run here: a directory with a manifest is kept
    as it is; an empty one is handed to `cosyserve download` (which fails: no hub here)."""
    resources = _build("cpu")
    kept = _run_fetch(resources, tiny_model_dir, tmp_path)
    assert kept.returncode == 0 and not kept.stdout and not kept.stderr
    fetched = _run_fetch(resources, tmp_path / "empty", tmp_path)
    assert fetched.returncode == 2
    assert "download from FunAudioLLM/CosyVoice2-0.5B failed" in fetched.stderr


def test_cpu_and_gpu_overlays_pick_their_images_and_resources() -> None:
    for overlay, tag in (("cpu", "cpu"), ("gpu", "cuda")):
        resources = _build(overlay)
        container = _container(resources)
        assert container["image"] == f"cosyserve:{tag}"
        # The HPA's CPU target is a share of the requests.
        assert container["resources"]["requests"]["cpu"]
        gpus = container["resources"].get("limits", {}).get("nvidia.com/gpu")
        assert (gpus == 1) == (overlay == "gpu")


def test_queue_depth_scaling() -> None:
    resources = _build("queue-hpa")
    metrics = _one(resources, "HorizontalPodAutoscaler")["spec"]["metrics"]
    assert {m["type"] for m in metrics} == {"Resource", "Pods"}
    monitor = _one(resources, "ServiceMonitor")
    service = _one(resources, "Service")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert endpoint["path"] == "/metrics" and served("/metrics")
    credentials = endpoint["authorization"]["credentials"]
    secret = next(
        r for r in resources if r["kind"] == "Secret" and r["metadata"]["name"] == credentials["name"]
    )
    assert credentials["key"] in secret["data"]


# -- the RayService --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rayservice() -> Resource:
    data: Resource = yaml.safe_load((K8S / "ray" / "rayservice.yaml").read_text())
    return data


def _pod_templates(rayservice: Resource) -> list[Resource]:
    cluster = rayservice["spec"]["rayClusterConfig"]
    return [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]


def test_rayservice_pods_are_valid_kubernetes(rayservice: Resource) -> None:
    assert (rayservice["apiVersion"], rayservice["kind"]) == ("ray.io/v1", "RayService")
    for template in _pod_templates(rayservice):
        _validate(
            {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": template}
        )


def test_rayservice_serves_cosyserves_ray_app(rayservice: Resource) -> None:
    config = yaml.safe_load(rayservice["spec"]["serveConfigV2"])
    (app,) = config["applications"]
    assert app["import_path"] == RAY_APP
    module, attribute = RAY_APP.split(":")
    source = ROOT / "src" / Path(*module.split(".")).with_suffix(".py")
    assert attribute in {n.name for n in ast.parse(source.read_text()).body if isinstance(n, ast.FunctionDef)}
    plan = plan_ray_app(app["args"])  # cosyserve's own check of the arguments
    workers = rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    (worker,) = workers
    # Each replica fits a worker pod, and the worker group can hold the most replicas.
    requested = float(worker["template"]["spec"]["containers"][0]["resources"]["requests"]["cpu"])
    assert plan.options["ray_actor_options"]["num_cpus"] <= requested
    assert worker["maxReplicas"] >= plan.options["autoscaling_config"]["max_replicas"]
    # Weights: fetched by the init container into the volume the replicas read model_dir from.
    (init,) = worker["template"]["spec"]["initContainers"]
    assert f"--dir {app['args']['model_dir']}" in shlex.join(init["command"])
    mounts = worker["template"]["spec"]["containers"][0]["volumeMounts"]
    assert any(Path(app["args"]["model_dir"]).is_relative_to(m["mountPath"]) for m in mounts)


def test_rayservice_probes_need_no_tools_the_image_lacks(rayservice: Resource) -> None:
    """KubeRay adds exec probes that run wget unless a container has its own; the image has
    no wget, so every Ray container brings HTTP probes on ports it declares or Ray's agent's."""
    for template in _pod_templates(rayservice):
        (container,) = template["spec"]["containers"]
        ports = {p["name"] for p in container.get("ports", [])}
        for probe in ("readinessProbe", "livenessProbe"):
            port = container[probe]["httpGet"]["port"]
            assert port in ports or port == 52365, f"{container['name']} {probe} port {port}"


def test_rayservice_environment_names_real_settings(rayservice: Resource) -> None:
    for template in _pod_templates(rayservice):
        for container in template["spec"]["containers"]:
            names = [e["name"] for e in container.get("env", []) if e["name"].startswith(ENV_PREFIX)]
            assert names
            for name in names:
                assert name.removeprefix(ENV_PREFIX).lower() in Settings.model_fields, name
