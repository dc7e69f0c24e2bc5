# The two commands of the README: `make serve` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PORT   ?= 8000

.PHONY: serve test test-slow deploy-test bench soak venv-serve venv-dev venv-bench

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
	$(BIN)/python -m pytest -m "not slow and not gpu and not soak and not docker" -q

test-slow: venv-dev
	$(BIN)/python -m pytest -m "slow" -q

# The deployment for real (tests/docker/test_deploy_stack.py): builds docker/Dockerfile.cpu, starts
# the compose stack's attnserve and Prometheus, checks every dashboard query and the drain, and
# writes its figures to bench/results/deploy. Starts a Docker engine (and base images without a
# registry) through tests/docker/engine.sh where it can (root, apt-get); fails where it cannot.
# The build uses the layer cache; ATTNSERVE_DOCKER_NO_CACHE=1 builds without it.
deploy-test: venv-dev
	ATTNSERVE_DOCKER_REQUIRED=1 ATTNSERVE_DEPLOY_OUT=bench/results/deploy \
		$(BIN)/python -m pytest -m docker -q tests/docker

bench: venv-bench
	$(BIN)/attnserve bench --models models --data-dir data --out bench/results/cpu \
		--sentences 1000 --summaries 300 --concurrency 1 8 32 64 --duration-s 120

# Reliability under load (RELIABILITY.md): 60 s at 3x capacity, a killed worker, a 10-minute
# soak. Shorter: make soak ATTNSERVE_OVERLOAD_S=20 ATTNSERVE_SOAK_S=120
soak: venv-dev
	ATTNSERVE_RELIABILITY_OUT=bench/results/reliability $(BIN)/python -m pytest -m soak -q -s
