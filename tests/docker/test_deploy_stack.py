"""The deployment for real: docker/Dockerfile.cpu built, docker/docker-compose.yml started.

On a Docker engine (conftest.py: tests/docker/engine.sh starts one where it can), in file order:
the CPU image is built unchanged, the compose stack's attnserve and Prometheus services start
(Grafana is left out by naming the services: its image cannot be had without a registry; the
file still starts it by default), attnserve is reached only through the ports the file
publishes on 127.0.0.1, every PromQL expression of the Grafana dashboard is run against the
stack's own Prometheus, and the last test stops attnserve under load to see it drain.

With ATTNSERVE_DEPLOY_OUT set, what was measured (build time, image size, time to ready, the
drain) is written there as deploy.json and deploy.md, once every test has passed.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.docker.conftest import Engine
from tests.docker.test_deploy_files import _autoscaling_queries

pytestmark = pytest.mark.docker

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
COMPOSE = DOCKER / "docker-compose.yml"
DOCKERFILE = DOCKER / "Dockerfile.cpu"
DASHBOARD = DOCKER / "grafana" / "dashboards" / "attnserve.json"
DATASOURCES = DOCKER / "grafana" / "provisioning" / "datasources"
MODELS = ROOT / "models"
PROJECT = "attnserve-deploy-test"  # compose project: its own containers, network and volume
SERVICES = ("attnserve", "prometheus")  # Grafana left out: no image without a registry
STANDIN_LABEL = "org.attnserve.stand-in"  # engine.sh's label on the base images it built

SENTENCES = [
    "The package provides a library for reading and writing compressed files.",
    "This tool converts images between many formats.",
    "It includes the documentation and several examples.",
    "The server stores its configuration in a simple text file.",
    "This package contains the development headers of the library.",
    "A small utility to monitor the network traffic of each process.",
]
DESCRIPTION = (
    "This package provides a command line tool and a library to read, write and convert "
    "audio files in many formats. It supports metadata tags and can resample the sound."
)


def _compose_yaml() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def _docker(*args: str, env: dict[str, str], timeout_s: float = 120, check: bool = True
            ) -> subprocess.CompletedProcess:
    result = subprocess.run(
        ["docker", *args], env=env, capture_output=True, text=True, timeout=timeout_s,
        stdin=subprocess.DEVNULL, check=False,
    )
    if check:
        assert result.returncode == 0, f"docker {' '.join(args)}:\n{result.stdout}{result.stderr}"
    return result


def _inspect(name: str, env: dict[str, str], kind: str = "container") -> dict[str, Any]:
    return json.loads(_docker(kind, "inspect", name, env=env).stdout)[0]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _seconds(duration: str) -> float:
    """A compose duration ("30s", "1m30s") in seconds."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, duration
    return sum(float(n) * units[u] for n, u in parts)


# ---- the image ----------------------------------------------------------------------------------


@dataclass
class Image:
    name: str
    no_cache: bool
    build_s: float
    steps: int
    cached_steps: int
    size_bytes: int
    base: str
    base_size_bytes: int
    base_stand_in: str | None


@pytest.fixture(scope="module")
def results(docker_engine: Engine) -> Iterator[dict[str, Any]]:
    """What the tests measure; written to $ATTNSERVE_DEPLOY_OUT when every test has passed."""
    measured: dict[str, Any] = {"since": docker_engine.since,
                                "engine": {"started_here": docker_engine.started_here,
                                           "base_images": docker_engine.base_images}}
    yield measured
    out = os.environ.get("ATTNSERVE_DEPLOY_OUT")
    if out and measured.get("complete"):
        _write_results(Path(out), measured)


def _image_id(ref: str, env: dict[str, str]) -> str | None:
    found = _docker("image", "inspect", "-f", "{{.Id}}", ref, env=env, check=False)
    return found.stdout.strip() if found.returncode == 0 else None


def _keep_only_this_build(name: str, previous: set[str | None], dangling_before: set[str],
                          env: dict[str, str]) -> None:
    """Tag the build stage's image of the build just made `NAME-build` (the layer cache of the
    next build, which the classic builder leaves untagged) and remove the images of the
    previous build, so that rebuilding does not fill the disk."""
    dangling = set(_docker("images", "-q", "--no-trunc", "-f", "dangling=true", env=env)
                   .stdout.split())
    new_stage = dangling - dangling_before - previous
    if len(new_stage) == 1:
        _docker("tag", new_stage.pop(), f"{name}-build", env=env)
    current = {_image_id(name, env), _image_id(f"{name}-build", env)}
    for old in previous - current:
        _docker("rmi", str(old), env=env, check=False)  # in use by a container: kept


@pytest.fixture(scope="module")
def image(docker_engine: Engine, results: dict[str, Any]) -> Image:
    """docker/Dockerfile.cpu built as-is under the name the compose file gives it."""
    env = docker_engine.env
    name = _compose_yaml()["services"]["attnserve"]["image"]
    base = re.search(r"^ARG PYTHON_IMAGE=(\S+)$", DOCKERFILE.read_text(), re.MULTILINE)
    assert base, "docker/Dockerfile.cpu names no PYTHON_IMAGE"
    no_cache = os.environ.get("ATTNSERVE_DOCKER_NO_CACHE") == "1"
    args = ["build", *(["--no-cache"] if no_cache else []), "-f", str(DOCKERFILE), "-t", name,
            str(ROOT)]
    previous = {_image_id(ref, env) for ref in (name, f"{name}-build")} - {None}
    dangling = set(_docker("images", "-q", "--no-trunc", "-f", "dangling=true", env=env)
                   .stdout.split())
    started = time.monotonic()
    build = _docker(*args, env={**env, "DOCKER_BUILDKIT": "0"}, timeout_s=1800)
    build_s = time.monotonic() - started
    _keep_only_this_build(name, previous, dangling, env)
    base_config = _inspect(base.group(1), env, "image")
    built = Image(
        name=name,
        no_cache=no_cache,
        build_s=build_s,
        steps=len(re.findall(r"^Step \d+/\d+ :", build.stdout, re.MULTILINE)),
        cached_steps=build.stdout.count("---> Using cache"),
        size_bytes=int(_inspect(name, env, "image")["Size"]),
        base=base.group(1),
        base_size_bytes=int(base_config["Size"]),
        base_stand_in=(base_config["Config"].get("Labels") or {}).get(STANDIN_LABEL),
    )
    results["image"] = built.__dict__
    return built


# ---- the stack ----------------------------------------------------------------------------------


@dataclass
class Stack:
    env: dict[str, str]
    attnserve: str  # base URL through the published port
    prometheus: str
    grpc: str  # host:port of KServe v2 over gRPC, through the published port
    container: str  # attnserve's container id
    up_s: float = 0.0
    ready_s: float = 0.0
    healthy_s: float = 0.0

    def compose(self, *args: str, timeout_s: float = 300, check: bool = True
                ) -> subprocess.CompletedProcess:
        return _docker("compose", "-f", str(COMPOSE), "-p", PROJECT, *args, env=self.env,
                       timeout_s=timeout_s, check=check)

    def service_logs(self) -> str:
        return self.compose("logs", "--no-color", "--tail", "60", timeout_s=60, check=False).stdout

    def health(self) -> str:
        state = _inspect(self.container, self.env)["State"]
        return str(state.get("Health", {}).get("Status"))


def _wait(predicate: Any, timeout_s: float, what: str, stack: Stack) -> float:
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout_s:
            pytest.fail(f"{what} not within {timeout_s:.0f}s; logs:\n{stack.service_logs()}")
        time.sleep(0.2)
    return time.monotonic() - started


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def stack(docker_engine: Engine, image: Image, results: dict[str, Any]) -> Iterator[Stack]:
    """attnserve and Prometheus of docker/docker-compose.yml, on free loopback ports."""
    ports = {"ATTNSERVE_HOST_PORT": _free_port(), "ATTNSERVE_GRPC_HOST_PORT": _free_port(),
             "PROMETHEUS_HOST_PORT": _free_port()}
    env = {**docker_engine.env, **{k: str(v) for k, v in ports.items()}}
    env.pop("ATTNSERVE_BIND", None)  # the file's default: 127.0.0.1
    stack = Stack(
        env=env,
        attnserve=f"http://127.0.0.1:{ports['ATTNSERVE_HOST_PORT']}",
        prometheus=f"http://127.0.0.1:{ports['PROMETHEUS_HOST_PORT']}",
        grpc=f"127.0.0.1:{ports['ATTNSERVE_GRPC_HOST_PORT']}",
        container="",
    )
    stack.compose("down", "-v", "-t", "5")  # what a crashed run left
    started = time.monotonic()
    try:
        stack.compose("up", "-d", "--no-build", "--pull", "never", *SERVICES)
        stack.up_s = time.monotonic() - started
        stack.container = stack.compose("ps", "-q", "attnserve").stdout.strip()
        assert stack.container, stack.service_logs()
        timeout = 180.0
        stack.ready_s = stack.up_s + _wait(lambda: _ready(stack.attnserve), timeout,
                                           "GET /health/ready 200", stack)
        stack.healthy_s = stack.up_s + _wait(lambda: stack.health() == "healthy", timeout,
                                             "the container's HEALTHCHECK healthy", stack)
        results["start"] = {"compose_up_s": stack.up_s, "ready_s": stack.ready_s,
                            "healthy_s": stack.healthy_s}
        yield stack
    finally:
        stack.compose("down", "-v", "-t", "5", check=False)


# ---- tests --------------------------------------------------------------------------------------


def test_image_is_built_from_the_dockerfile(image: Image, docker_engine: Engine) -> None:
    config = _inspect(image.name, docker_engine.env, "image")["Config"]
    assert config["User"] == "10001:10001"
    assert config["Cmd"] == ["attnserve", "serve", "--host", "0.0.0.0", "--port", "8000",
                             "--grpc-port", "8001", "--models", "/app/models"]
    assert "/health/ready" in " ".join(config["Healthcheck"]["Test"])
    assert {"8000/tcp", "8001/tcp"} <= set(config["ExposedPorts"])
    assert image.size_bytes > image.base_size_bytes


def test_container_runs_as_non_root_on_a_read_only_root(stack: Stack) -> None:
    host = _inspect(stack.container, stack.env)["HostConfig"]
    assert host["ReadonlyRootfs"] is True
    assert host["CapDrop"] == ["ALL"]
    assert "no-new-privileges:true" in host["SecurityOpt"]
    probe = (
        "import os, json\n"
        "def writable(path):\n"
        "    try:\n"
        "        with open(os.path.join(path, '.probe'), 'w') as f: f.write('x')\n"
        "        os.remove(os.path.join(path, '.probe')); return True\n"
        "    except OSError as e: return e.strerror\n"
        "status = dict(l.split(':', 1) for l in open('/proc/1/status'))\n"
        "print(json.dumps({'uid': os.getuid(), 'pid1_uid': status['Uid'].split()[0],\n"
        "    'caps': status['CapEff'].strip(),\n"
        "    'write': {p: writable(p) for p in ['/', '/app', '/app/models', '/opt/venv', '/tmp']}}))"
    )
    out = _docker("exec", stack.container, "python", "-c", probe, env=stack.env).stdout
    seen = json.loads(out)
    assert seen["uid"] == 10001 and seen["pid1_uid"] == "10001", seen
    assert int(seen["caps"], 16) == 0, seen  # no capabilities at all
    assert seen["write"]["/tmp"] is True, seen
    for path in ["/", "/app", "/app/models", "/opt/venv"]:
        assert seen["write"][path] == "Read-only file system", (path, seen)


def test_healthcheck_and_readiness(stack: Stack) -> None:
    assert stack.health() == "healthy"
    ready = httpx.get(f"{stack.attnserve}/health/ready", timeout=5)
    assert ready.status_code == 200
    assert ready.json()["status"] == "ready"
    ports = _inspect(stack.container, stack.env)["NetworkSettings"]["Ports"]["8000/tcp"]
    assert {p["HostIp"] for p in ports} == {"127.0.0.1"}


def test_models_show_provider_and_variant(stack: Stack) -> None:
    listed = httpx.get(f"{stack.attnserve}/v1/models", timeout=5).json()["models"]
    repositories = sorted(p.parent.name for p in MODELS.glob("*/manifest.json"))
    assert sorted(m["name"] for m in listed) == repositories
    for card in listed:
        manifest = json.loads((MODELS / card["name"] / "manifest.json").read_text())
        assert card["ready"] is True, card
        assert card["provider"] == "CPUExecutionProvider", card
        assert card["variant"] in manifest["variants"], card
        assert card["task"] == manifest["task"], card


def test_translate_and_summarize_through_the_published_port(stack: Stack) -> None:
    with httpx.Client(base_url=stack.attnserve, timeout=60) as client:
        translated = client.post("/v1/translate", json={"texts": SENTENCES[:2]})
        summarized = client.post("/v1/summarize", json={"text": DESCRIPTION})
        refused = client.post("/v1/translate", json={"text": "x" * 100_000})
    assert translated.status_code == 200, translated.text
    first, second = translated.json()["outputs"]
    assert "pacchetto" in first["text"].lower() and "libreria" in first["text"].lower(), first
    assert second["text"] and second["output_tokens"] > 0, second
    assert summarized.status_code == 200, summarized.text
    synopsis = summarized.json()["outputs"][0]
    assert synopsis["text"] and "\n" not in synopsis["text"], synopsis
    assert len(synopsis["text"]) < len(DESCRIPTION), synopsis
    assert refused.status_code == 422 and "error" in refused.json(), refused.text


def test_open_inference_protocol_through_the_published_port(stack: Stack) -> None:
    """The v2 routes the KServe predictor (docker/kserve) is probed and called on."""
    with httpx.Client(base_url=stack.attnserve, timeout=60) as client:
        live = client.get("/v2/health/live")
        ready = client.get("/v2/health/ready")
        inferred = client.post("/v2/models/translate-en-it/infer", json={"inputs": [
            {"name": "text", "datatype": "BYTES", "shape": [1], "data": [SENTENCES[0]]}]})
    assert live.status_code == 200 and ready.status_code == 200
    assert inferred.status_code == 200, inferred.text
    outputs = {o["name"]: o["data"] for o in inferred.json()["outputs"]}
    assert "pacchetto" in outputs["output"][0].lower(), outputs


def test_openai_and_libretranslate_apis_through_the_published_port(stack: Stack) -> None:
    """The container's OpenAI and LibreTranslate routes give `/v1/translate`'s translation."""
    with httpx.Client(base_url=stack.attnserve, timeout=60) as client:
        expected = client.post("/v1/translate", json={"text": SENTENCES[0]}).json()["outputs"][0]["text"]
        chat = client.post("/v1/chat/completions", json={
            "model": "translate-en-it", "messages": [{"role": "user", "content": SENTENCES[0]}]})
        libre = client.post("/translate", json={"q": SENTENCES[0], "source": "en", "target": "it"})
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["message"]["content"] == expected
    assert libre.status_code == 200 and libre.json() == {"translatedText": expected}, libre.text


def test_grpc_through_the_published_port(stack: Stack) -> None:
    """KServe v2 over gRPC (the image's --grpc-port 8001) with the stock client: the REST
    route's output for the same sentence."""
    import numpy as np

    grpcclient = pytest.importorskip("tritonclient.grpc")
    with httpx.Client(base_url=stack.attnserve, timeout=60) as client:
        rest = client.post("/v2/models/translate-en-it/infer", json={"inputs": [
            {"name": "text", "datatype": "BYTES", "shape": [1], "data": [SENTENCES[0]]}]})
    client = grpcclient.InferenceServerClient(stack.grpc)
    try:
        assert client.is_server_ready() and client.is_model_ready("translate-en-it")
        text = grpcclient.InferInput("text", [1], "BYTES")
        text.set_data_from_numpy(np.array([SENTENCES[0].encode()], dtype=np.object_))
        result = client.infer("translate-en-it", [text])
    finally:
        client.close()
    assert [t.decode() for t in result.as_numpy("output").tolist()] == rest.json()["outputs"][0]["data"]


# ---- Prometheus and the dashboard ---------------------------------------------------------------


def _prometheus(stack: Stack, path: str, **params: Any) -> Any:
    response = httpx.get(f"{stack.prometheus}{path}", params=params, timeout=30)
    assert response.status_code == 200, f"{path} {params}: {response.text}"
    body = response.json()
    assert body["status"] == "success", body
    return body["data"]


def _scrape_interval_s() -> float:
    """The datasource's `timeInterval` (Grafana's minimum step: the scrape interval)."""
    (datasource,) = [d for f in DATASOURCES.glob("*.y*ml")
                     for d in yaml.safe_load(f.read_text())["datasources"]]
    return _seconds(datasource["jsonData"]["timeInterval"])


def _dashboard_expressions() -> list[tuple[str, str]]:
    """(panel title, expr) of every target of every panel, rows' panels included."""
    dashboard = json.loads(DASHBOARD.read_text())
    panels = []
    for panel in dashboard["panels"]:
        panels.append(panel)
        panels.extend(panel.get("panels", []))
    return [(p["title"], t["expr"]) for p in panels for t in p.get("targets", [])]


def _traffic(stack: Stack, seconds: float) -> dict[str, int]:
    """Requests to every model for `seconds`, concurrent enough to batch, with the errors the
    dashboard's error panels count: a text over the character limit (422) and a deadline too
    short to meet (504, rejected as `deadline`). Returns the count of each status code."""
    counts: dict[str, int] = {}
    lock = threading.Lock()
    stop_at = time.monotonic() + seconds

    def client(worker: int) -> None:
        with httpx.Client(base_url=stack.attnserve, timeout=60) as http:
            i = worker
            while time.monotonic() < stop_at:
                route = "/v1/translate" if i % 2 == 0 else "/v1/summarize"
                text = SENTENCES[i % len(SENTENCES)] if route == "/v1/translate" else DESCRIPTION
                body: dict[str, Any] = {"texts": [text, SENTENCES[(i + 1) % len(SENTENCES)]]}
                if i % 7 == 3:
                    body = {"text": "word " * 5000}  # over the character limits: 422
                elif i % 7 == 5:
                    body["timeout_ms"] = 1  # passes before any result: 504
                status = http.post(route, json=body).status_code
                with lock:
                    counts[str(status)] = counts.get(str(status), 0) + 1
                i += 1

    with ThreadPoolExecutor(6) as pool:
        list(pool.map(client, range(6)))
    return counts


def test_prometheus_scrapes_attnserve(stack: Stack) -> None:
    deadline = time.monotonic() + 60
    while True:
        targets = _prometheus(stack, "/api/v1/targets")["activeTargets"]
        ours = [t for t in targets if t["labels"]["job"] == "attnserve"]
        if ours and all(t["health"] == "up" for t in ours):
            break
        assert time.monotonic() < deadline, f"attnserve targets not up: {ours}"
        time.sleep(1)
    (up,) = _prometheus(stack, "/api/v1/query", query='up{job="attnserve"}')["result"]
    assert up["value"][1] == "1"
    assert up["metric"]["instance"] == "attnserve:8000"


def test_every_dashboard_query_returns_data(stack: Stack, results: dict[str, Any]) -> None:
    scrape_s = _scrape_interval_s()
    started = time.time()
    counts = _traffic(stack, seconds=6 * scrape_s)
    assert counts.get("200", 0) > 10 and counts.get("422") and counts.get("504"), counts
    time.sleep(2 * scrape_s)  # the last requests scraped
    ended = time.time()

    # The dashboard's `model` variable: label_values(attnserve_model_info, model), plus "All".
    models = _prometheus(stack, "/api/v1/label/model/values",
                         **{"match[]": "attnserve_model_info"})
    listed = httpx.get(f"{stack.attnserve}/v1/models", timeout=5).json()["models"]
    assert sorted(models) == sorted(m["name"] for m in listed)
    # Grafana's $__rate_interval: max($__interval + scrape interval, 4 x scrape interval), with
    # $__interval the query step (here the scrape interval).
    step_s = scrape_s
    rate_interval = f"{int(max(step_s + scrape_s, 4 * scrape_s))}s"

    empty = []
    checked = 0
    # The panels, for "All" (the variable's allValue) and each model; and the autoscalers'
    # queue-depth query (docker/k8s, docker/kserve: the job name is the same here).
    panels = [(model, title, expr) for model in [".*", *models]
              for title, expr in _dashboard_expressions()]
    panels += [("-", f"autoscaling ({where})", query) for where, query in _autoscaling_queries()]
    for model, title, expr in panels:
        query = expr.replace("$__rate_interval", rate_interval).replace("$model", model)
        assert "$" not in query, f"{title}: unsubstituted variable in {query}"
        series = _prometheus(stack, "/api/v1/query_range", query=query, start=started,
                             end=ended, step=step_s)["result"]
        values = [float(v) for s in series for _, v in s["values"]]
        checked += 1
        if not any(math.isfinite(v) for v in values):
            empty.append(f"{title} [model={model}]: {query} -> {series}")
    assert not empty, "queries without data:\n" + "\n".join(empty)
    version = _prometheus(stack, "/api/v1/status/buildinfo")["version"]
    results["dashboard"] = {"queries_checked": checked, "models": models,
                            "prometheus_version": version,
                            "traffic_status_counts": counts, "rate_interval": rate_interval}


def test_stop_under_load_drains(stack: Stack, results: dict[str, Any]) -> None:
    """`docker compose stop` while requests run: every request sent before the stop command
    began and not answered by then finishes with 200, and the container exits 0 within the
    grace period. Requests sent later may be refused (the server stops accepting)."""
    grace_s = _seconds(_compose_yaml()["services"]["attnserve"]["stop_grace_period"])
    outcomes: list[tuple[float, float, int | str]] = []  # (sent, finished, status or error)
    lock = threading.Lock()
    stopping = threading.Event()
    texts = [f"{s} {t}" for s in SENTENCES for t in SENTENCES[:2]][:12]  # seconds per request

    def client(worker: int) -> None:
        # A connection per request: a request sent over an idle kept-alive connection as the
        # server stops is refused by design (uvicorn closes idle connections at shutdown).
        while not stopping.is_set():
            sent = time.monotonic()
            try:
                response = httpx.post(f"{stack.attnserve}/v1/translate", timeout=grace_s + 10,
                                      json={"texts": texts, "beam_size": 4})
                status: int | str = response.status_code
            except httpx.HTTPError as error:
                status = type(error).__name__
                time.sleep(0.05)
            with lock:
                outcomes.append((sent, time.monotonic(), status))

    pool = ThreadPoolExecutor(8)
    futures = [pool.submit(client, w) for w in range(8)]
    time.sleep(3)  # load running: rows queued and batched
    stop_at = time.monotonic()
    stop = stack.compose("stop", "attnserve", timeout_s=grace_s + 30)
    stop_s = time.monotonic() - stop_at
    stopping.set()
    for future in futures:
        future.result(timeout=grace_s + 20)
    pool.shutdown()

    state = _inspect(stack.container, stack.env)["State"]
    running = [o for o in outcomes if o[0] < stop_at <= o[1]]
    before = [o for o in outcomes if o[1] < stop_at]
    assert before and all(o[2] == 200 for o in before), before
    timeline = f"stop at {stop_at:.3f}, (sent, finished, status): {outcomes}"
    assert running, f"no request was running when the stop began; {timeline}"
    assert all(o[2] == 200 for o in running), f"running requests not all answered; {timeline}"
    assert state["Status"] == "exited" and state["ExitCode"] == 0 and not state["OOMKilled"], (
        state, stack.service_logs())
    assert stop_s < grace_s, f"stop took {stop_s:.1f}s (grace {grace_s:.0f}s): {stop.stderr}"
    results["drain"] = {
        "requests_before_stop": len(before),
        "requests_running_at_stop": len(running),
        "running_answered_200": sum(o[2] == 200 for o in running),
        "later_requests": sorted({str(o[2]) for o in outcomes if o[0] >= stop_at}),
        "stop_s": stop_s,
        "grace_period_s": grace_s,
        "exit_code": state["ExitCode"],
    }
    results["complete"] = True


# ---- results ------------------------------------------------------------------------------------


def _engine_versions() -> dict[str, str]:
    def out(*args: str) -> str:
        result = subprocess.run(args, capture_output=True, text=True, timeout=30, check=False)
        return result.stdout.strip()

    return {
        "docker_server": out("docker", "version", "--format", "{{.Server.Version}}"),
        "compose": out("docker", "compose", "version", "--short"),
    }


def _write_results(out: Path, measured: dict[str, Any]) -> None:
    image, start, drain = measured["image"], measured["start"], measured["drain"]
    record = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "arch": platform.machine(), **_engine_versions()},
        "image": image,
        "start": start,
        "dashboard": measured["dashboard"],
        "drain": drain,
        "engine": measured["engine"],
        "stage_s": time.monotonic() - measured["since"],
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "deploy.json").write_text(json.dumps(record, indent=2) + "\n")
    mb = 1e6
    base = image["base"] + (f" (stand-in: {image['base_stand_in']})" if image["base_stand_in"]
                            else "")
    lines = [
        "# The compose stack, built and run (`make deploy-test`)",
        "",
        (f"{record['date']}, {record['machine']['cpus']} CPUs, Docker "
        f"{record['machine']['docker_server']}, compose {record['machine']['compose']}."),
        "",
        "| figure | value | command |",
        "|---|---|---|",
        (f"| build time | {image['build_s']:.1f} s ({image['cached_steps']} of {image['steps']} "
        f"steps from cache) | `docker build{' --no-cache' if image['no_cache'] else ''} "
        "-f docker/Dockerfile.cpu -t attnserve:0.1.0 .` |"),
        (f"| image size | {image['size_bytes'] / mb:.0f} MB: base image "
        f"{image['base_size_bytes'] / mb:.0f} MB, attnserve's layers "
        f"{(image['size_bytes'] - image['base_size_bytes']) / mb:.0f} MB | "
        "`docker image inspect -f '{{.Size}}' attnserve:0.1.0` |"),
        (f"| time to ready | {start['ready_s']:.1f} s (`/health/ready` 200); HEALTHCHECK "
        f"healthy at {start['healthy_s']:.1f} s | `docker compose -f docker/docker-compose.yml "
        "up -d` |"),
        (f"| drain | {drain['requests_running_at_stop']} running requests, "
        f"{drain['running_answered_200']} answered 200; exit code {drain['exit_code']} after "
        f"{drain['stop_s']:.1f} s (grace {drain['grace_period_s']:.0f} s) | `docker compose -f "
        "docker/docker-compose.yml stop attnserve` |"),
        (f"| dashboard | {measured['dashboard']['queries_checked']} queries (every panel, model "
        "= All and each model, and the autoscalers' query) returned data from Prometheus "
        f"{measured['dashboard']['prometheus_version']} | `make deploy-test` |"),
        f"| whole stage | {record['stage_s']:.0f} s | `make deploy-test` |",
        "",
        f"Base image: {base}.",
        "",
    ]
    if not image["no_cache"]:
        lines.append("Build time with the layer cache; `ATTNSERVE_DOCKER_NO_CACHE=1 make "
                     "deploy-test` measures a build without it.\n")
    (out / "deploy.md").write_text("\n".join(lines))
