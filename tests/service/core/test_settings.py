"""Settings from the environment and from the flags of `attnserve serve`."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from attnserve.cli import build_parser
from service.core.settings import DEFAULT_PROVIDERS, Settings
from service.process import commands


def test_defaults() -> None:
    settings = Settings()
    assert settings.models_dir == Path("models")
    assert settings.providers == DEFAULT_PROVIDERS
    assert settings.providers[0] == "CUDAExecutionProvider"


def test_environment_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATTNSERVE_PROVIDERS", "CPUExecutionProvider")
    monkeypatch.setenv("ATTNSERVE_MAX_BATCH_SIZE", "7")
    monkeypatch.setenv("ATTNSERVE_MAX_WAIT_MS", "2.5")
    monkeypatch.setenv("ATTNSERVE_MODELS_DIR", "/srv/models")
    settings = Settings()
    assert settings.providers == ("CPUExecutionProvider",)
    assert (settings.max_batch_size, settings.max_wait_ms) == (7, 2.5)
    assert settings.models_dir == Path("/srv/models")


def test_flags_win_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATTNSERVE_MAX_BATCH_SIZE", "7")
    monkeypatch.setenv("ATTNSERVE_PORT", "9000")
    args = build_parser().parse_args(
        ["serve", "--models", "elsewhere", "--max-batch-size", "3",
         "--providers", "CUDAExecutionProvider, CPUExecutionProvider"])
    settings = commands.settings_from_args(args)
    assert settings.max_batch_size == 3
    assert settings.port == 9000
    assert settings.models_dir == Path("elsewhere")
    assert settings.providers == DEFAULT_PROVIDERS


def test_the_step_graph_setting_reaches_the_runtime(monkeypatch: pytest.MonkeyPatch, tiny_model_repository: Path) -> None:
    """`--step-graph`/`--no-step-graph` (or ATTNSERVE_STEP_GRAPH) decide whether continuous
    batching runs on the step graph; unset, the provider's default (the CPU serves it)."""
    from service.core.registry import onnx_loader

    parse = build_parser().parse_args
    assert commands.settings_from_args(parse(["serve"])).step_graph is None
    assert commands.settings_from_args(parse(["serve", "--step-graph"])).step_graph is True
    assert commands.settings_from_args(parse(["serve", "--no-step-graph"])).step_graph is False
    base = {"providers": ("CPUExecutionProvider",), "threads": 1, "variant": "fp32"}
    assert onnx_loader(Settings(**base))(tiny_model_repository).step is not None
    assert onnx_loader(Settings(**base, step_graph=False))(tiny_model_repository).step is None
    monkeypatch.setenv("ATTNSERVE_STEP_GRAPH", "false")
    assert Settings().step_graph is False


def test_the_lone_step_setting_reaches_the_runtime(monkeypatch: pytest.MonkeyPatch, tiny_model_repository: Path) -> None:
    """`--lone-step`/`--no-lone-step` (or ATTNSERVE_LONE_STEP); unset, on CUDA only. The CPU
    serves none either way: its slots live in host memory, where the lone slot's fixed
    addresses buy nothing."""
    from service.core.registry import onnx_loader
    from service.runtime import model_runtime

    parse = build_parser().parse_args
    assert commands.settings_from_args(parse(["serve"])).lone_step is None
    assert commands.settings_from_args(parse(["serve", "--lone-step"])).lone_step is True
    assert commands.settings_from_args(parse(["serve", "--no-lone-step"])).lone_step is False
    asked = []
    original = model_runtime.ModelRuntime.load.__func__  # type: ignore[attr-defined]

    def load(cls, *args, **kwargs):
        asked.append(kwargs["lone_step"])
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(model_runtime.ModelRuntime, "load", classmethod(load))
    base = {"providers": ("CPUExecutionProvider",), "threads": 1, "variant": "fp32"}
    assert onnx_loader(Settings(**base, lone_step=True))(tiny_model_repository).lone is None
    assert asked == [True]
    monkeypatch.setenv("ATTNSERVE_LONE_STEP", "false")
    assert Settings().lone_step is False


def test_the_gpu_memory_limit_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    parse = build_parser().parse_args
    assert commands.settings_from_args(parse(["serve"])).gpu_memory_limit_mb == 0
    assert commands.settings_from_args(parse(["serve", "--gpu-memory-limit-mb", "2048"])).gpu_memory_limit_mb == 2048
    monkeypatch.setenv("ATTNSERVE_GPU_MEMORY_LIMIT_MB", "1024")
    assert Settings().gpu_memory_limit_mb == 1024
    with pytest.raises(ValidationError):
        Settings(gpu_memory_limit_mb=-1)


@pytest.mark.parametrize(
    "bad",
    [{"max_batch_size": -1}, {"providers": ""}, {"max_texts": 20, "max_queue_size": 10},
     {"max_texts": 10_000}, {"port": 70000}],
)
def test_invalid_settings(bad: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        Settings(**bad)  # type: ignore[arg-type]


def test_serve_refuses_invalid_settings() -> None:
    args = build_parser().parse_args(["serve", "--max-batch-size", "-1"])
    assert args.func(args) == 2


class _Registry:
    def __init__(self) -> None:
        self.draining = False

    def begin_draining(self) -> None:
        self.draining = True


def test_sigterm_turns_readiness_off_before_uvicorn_stops() -> None:
    import uvicorn

    registry = _Registry()
    server = commands._draining_server(uvicorn.Config(app=SimpleNamespace()), registry, 0)
    server.handle_exit(signal.SIGTERM, None)
    assert registry.draining and server.should_exit


def test_shutdown_delay_keeps_serving_then_stops() -> None:
    import uvicorn

    registry = _Registry()
    server = commands._draining_server(uvicorn.Config(app=SimpleNamespace()), registry, 0.2)
    server.handle_exit(signal.SIGTERM, None)
    assert registry.draining and not server.should_exit
    time.sleep(0.5)
    assert server.should_exit


def test_the_drain_budget_covers_the_request_timeout() -> None:
    from service.process.http import GuardedProtocol, uvicorn_options

    assert Settings().drain_timeout_s == Settings().request_timeout_s == 60
    assert Settings(request_timeout_s=90).drain_timeout_s == 90
    assert Settings(request_timeout_s=10, graceful_timeout_s=25).drain_timeout_s == 25
    with pytest.raises(ValidationError, match="graceful_timeout_s must be at least"):
        Settings(request_timeout_s=60, graceful_timeout_s=30)
    options = uvicorn_options(Settings(header_timeout_s=3, max_connections=7))
    assert options["timeout_graceful_shutdown"] == 60
    assert issubclass(options["http"], GuardedProtocol)
    assert options["http"].limits.header_timeout_s == 3
    assert options["http"].limits.max_connections == 7
    assert uvicorn_options(Settings(), workers=True)["http"] == "service.process.http:GuardedProtocol"


def test_the_kubernetes_grace_period_covers_the_pre_stop_wait_and_the_drain() -> None:
    import yaml

    root = Path(__file__).resolve().parents[3]
    deployment = yaml.safe_load((root / "docker/k8s/deployment.yaml").read_text())
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    pre_stop = int(container["lifecycle"]["preStop"]["exec"]["command"][1])
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + Settings().drain_timeout_s
