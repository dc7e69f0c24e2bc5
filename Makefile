# The two commands of the README: `make serve` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PORT   ?= 8000

.PHONY: serve test lint gpu-check gpu-wheels gpu-transfer test-slow test-newcomer deploy-test bench soak venv-serve venv-dev venv-bench

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# onnxruntime's CUDA build (the `gpu` extra) where an NVIDIA driver answers, else its CPU build
# (the `serve` extra); GPU=1 or GPU=0 decides. Both builds install the module `onnxruntime`, so
# the other one is removed first.
GPU    ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1 || echo 0)
ORT    := $(if $(filter 1,$(GPU)),gpu,serve)
OTHER  := $(if $(filter 1,$(GPU)),onnxruntime,onnxruntime-gpu)
ONE_ORT = $(BIN)/pip uninstall -q -y $(OTHER) 2>/dev/null || true

# Serving only: onnxruntime, FastAPI, no torch.
venv-serve: $(BIN)/python
	$(ONE_ORT)
	$(BIN)/pip install -q -e '.[$(ORT)]'

# Everything the tests need (training, export, serving).
venv-dev: $(BIN)/python
	$(ONE_ORT)
	$(BIN)/pip install -q -e '.[$(ORT),train,dev]'

# Benchmarks: the service, in-process ONNX, naive PyTorch and CTranslate2 (needs data/ prepared).
venv-bench: $(BIN)/python
	$(ONE_ORT)
	$(BIN)/pip install -q -e '.[$(ORT),train,bench]'

serve: venv-serve
	$(BIN)/attnserve serve --host 0.0.0.0 --port $(PORT) --models models

test: venv-dev
	$(BIN)/python -m pytest -m "not slow and not gpu and not soak and not newcomer and not docker" -q

# Style, types and the one-way layers (pyproject.toml's [tool.importlinter] contracts).
lint: venv-dev
	$(BIN)/ruff check .
	$(BIN)/mypy service export attnserve
	$(BIN)/lint-imports

# The CUDA execution provider verified and measured (bench/results/gpu/<gpu>/); on a machine
# without a GPU it says why and exits 0. OFFLINE=1: the python3 on PATH as it is (a host prepared
# with bench/GPU_OFFLINE.md), no virtualenv.
GPU_CHECK_ARGS ?=
gpu-check: $(if $(filter 1,$(OFFLINE)),,venv-dev)
	$(if $(filter 1,$(OFFLINE)),python3,$(BIN)/python) -m bench.gpu_check --out bench/results/gpu $(GPU_CHECK_ARGS)

# What a GPU host without network lacks for `make gpu-check OFFLINE=1` (CPython 3.12, x86-64), in
# $(WHEELS): onnxruntime-gpu xz-compressed in parts of PART_MB MiB, the serving stack, attnserve's own wheel.
# bench/GPU_OFFLINE.md is the procedure.
WHEELS  ?= .whl
ORT_GPU ?= onnxruntime-gpu==1.31.1
PART_MB ?= 60
PLATFORMS = --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
	--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
gpu-wheels: venv-dev
	rm -rf $(WHEELS) && mkdir -p $(WHEELS)
	$(BIN)/pip download -q --only-binary=:all: --python-version 3.12 --implementation cp $(PLATFORMS) \
		-d $(WHEELS) '$(ORT_GPU)' fastapi 'uvicorn[standard]' pydantic pydantic-settings \
		prometheus-client sentencepiece sentencex ctranslate2
	$(BIN)/python -m build -q --wheel --outdir $(WHEELS) .
	$(BIN)/python bench/gpu_offline.py split $(WHEELS)/onnxruntime_gpu-*.whl --max-mb $(PART_MB) --xz --remove

# After gpu-wheels, for transfers of at most TRANSFER_MB MiB besides the checkout without models/:
# the wheels a CUDA 13 host lacks and the models, in folders $(WHEELS)/transfer/NN of that size.
TRANSFER_MB ?= 60.5
gpu-transfer:
	rm -rf $(WHEELS)/transfer
	python3 bench/gpu_offline.py bundle $$(ls $(WHEELS)/onnxruntime_gpu-* $(WHEELS)/*.whl | grep -v -e ctranslate2 -e numpy) \
		models --max-mb $(TRANSFER_MB) --out $(WHEELS)/transfer

# A fresh clone of HEAD: `make serve` there, every README example against it, the wheel.
test-newcomer: venv-dev
	$(BIN)/python -m pytest -m newcomer -q

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
