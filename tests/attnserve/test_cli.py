"""The `attnserve` root command: only the chosen subcommand's module loads, and a missing
extra is one line naming it."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys

import pytest

from attnserve import cli


def _extra_only_modules() -> set[str]:
    """Top-level modules of the distributions that only the train, bench or dev extras bring
    (not the base dependencies, not the serving extras: server, serve, gpu, grpc and otel, whose
    opentelemetry FastAPI imports itself wherever it is installed)."""
    def normal(name: str) -> str:
        return re.sub(r"[-_.]+", "-", name).lower()

    serving, others = set(), set()
    for requirement in importlib.metadata.requires(cli.DISTRIBUTION) or []:
        name, _, marker = requirement.partition(";")
        distribution = normal(re.match(r"[A-Za-z0-9._-]+", name.strip()).group(0))
        extra = re.search(r"""extra\s*==\s*["']([^"']+)["']""", marker)
        (others if extra and extra.group(1) not in ("server", "serve", "gpu", "grpc", "otel") else serving).add(distribution)
    extra_only = others - serving
    return {module for module, distributions in importlib.metadata.packages_distributions().items()
            if any(normal(d) in extra_only for d in distributions)} | {"bench"}


def test_service_imports_nothing_of_the_train_or_bench_extras() -> None:
    forbidden = _extra_only_modules()
    assert {"torch", "httpx", "matplotlib", "ctranslate2", "bench"} <= forbidden
    probe = (
        "import importlib, json, pkgutil, sys, service\n"
        "for info in pkgutil.walk_packages(service.__path__, 'service.'):\n"
        "    importlib.import_module(info.name)\n"
        "from attnserve.cli import build_parser\n"
        "build_parser('serve').parse_args(['serve', '--port', '1'])\n"
        "print(json.dumps(sorted({name.split('.')[0] for name in sys.modules})))\n"
    )
    loaded = set(json.loads(subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True,
                                           text=True).stdout))
    assert "service" in loaded and "fastapi" in loaded
    assert not loaded & forbidden


def test_help_lists_every_subcommand_and_loads_none(capsys: pytest.CaptureFixture[str]) -> None:
    probe = ("import sys\nfrom attnserve.cli import main\n"
             "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
             "print(sorted(m for m in ('model.commands', 'export.commands', 'bench.commands', "
             "'service.process.commands') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True).stdout
    assert all(s.name in out for s in cli.SUBCOMMANDS)
    assert out.strip().splitlines()[-1] == "[]"


def test_a_missing_extra_is_one_line_naming_it(monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    installed = importlib.metadata.version

    def version(distribution: str) -> str:
        if distribution.lower() == "httpx":
            raise importlib.metadata.PackageNotFoundError(distribution)
        return installed(distribution)

    monkeypatch.setattr(importlib.metadata, "version", version)
    assert cli.main(["bench", "--help"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "httpx" in err and "pip install 'attnserve[serve,train,bench]'" in err
    with pytest.raises(SystemExit) as exited:  # serve needs no bench extra
        cli.main(["serve", "--help"])
    assert exited.value.code == 0


def test_a_module_missing_at_import_names_the_extra(monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(cli, "missing_requirements", lambda extras: [])  # as if run from a source tree
    monkeypatch.setitem(sys.modules, "bench.harness", None)  # importing it raises ModuleNotFoundError
    monkeypatch.delitem(sys.modules, "bench.commands", raising=False)
    assert cli.main(["bench", "--help"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "'bench.harness'" in err and "attnserve[serve,train,bench]" in err


def test_unknown_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["nope"])
    assert exited.value.code == 2
    assert "invalid choice: 'nope'" in capsys.readouterr().err


@pytest.mark.parametrize("how", ["flag", "environment"])
def test_log_lines_are_json_with_log_format_json(how: str) -> None:
    flag = ["--log-format", "json"] if how == "flag" else []
    environment = {**os.environ, **({"ATTNSERVE_LOG_FORMAT": "json"} if how == "environment" else {})}
    # an invalid port: `serve` logs one error and exits 2 before it binds anything
    done = subprocess.run([sys.executable, "-m", "attnserve.cli", *flag, "serve", "--port", "70000"],
                          check=False, capture_output=True, text=True, env=environment, timeout=60)
    assert done.returncode == 2, done.stderr
    [entry] = [json.loads(line) for line in done.stderr.splitlines()]
    assert entry["level"] == "ERROR" and entry["logger"] == "service.process.commands"
    assert entry["message"].startswith("invalid settings") and entry["time"].endswith("+00:00")


def test_log_lines_are_text_by_default() -> None:
    environment = {name: value for name, value in os.environ.items() if name != "ATTNSERVE_LOG_FORMAT"}
    done = subprocess.run([sys.executable, "-m", "attnserve.cli", "serve", "--port", "70000"],
                          check=False, capture_output=True, text=True, env=environment, timeout=60)
    assert done.returncode == 2
    assert re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ ERROR service\.process\.commands: invalid settings",
                    done.stderr)
