# The two commands of the README: `make serve` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PORT   ?= 8000

.PHONY: serve test lint test-slow test-newcomer bench soak venv-serve venv-dev venv-bench

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# Serving only: onnxruntime, FastAPI, no torch.
venv-serve: $(BIN)/python
	$(BIN)/pip install -q -e '.[serve]'

# Everything the tests need (training, export, serving).
venv-dev: $(BIN)/python
	$(BIN)/pip install -q -e '.[serve,train,dev]'

# Benchmarks: the service, in-process ONNX, naive PyTorch and CTranslate2 (needs data/ prepared).
venv-bench: $(BIN)/python
	$(BIN)/pip install -q -e '.[serve,train,bench]'

serve: venv-serve
	$(BIN)/attnserve serve --host 0.0.0.0 --port $(PORT) --models models

test: venv-dev
	$(BIN)/python -m pytest -m "not slow and not gpu and not soak and not newcomer" -q

# Style, types and the one-way layers (pyproject.toml's [tool.importlinter] contracts).
lint: venv-dev
	$(BIN)/ruff check .
	$(BIN)/mypy service export attnserve
	$(BIN)/lint-imports

# A fresh clone of HEAD: `make serve` there, every README example against it, the wheel.
test-newcomer: venv-dev
	$(BIN)/python -m pytest -m newcomer -q

test-slow: venv-dev
	$(BIN)/python -m pytest -m "slow" -q

bench: venv-bench
	$(BIN)/attnserve bench --models models --data-dir data --out bench/results/cpu \
		--sentences 1000 --summaries 300 --concurrency 1 8 32 64 --duration-s 120

# Reliability under load (RELIABILITY.md): 60 s at 3x capacity, a killed worker, a 10-minute
# soak. Shorter: make soak ATTNSERVE_OVERLOAD_S=20 ATTNSERVE_SOAK_S=120
soak: venv-dev
	ATTNSERVE_RELIABILITY_OUT=bench/results/reliability $(BIN)/python -m pytest -m soak -q -s
