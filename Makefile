# The two entry points: `make demo` (the main job on whatever this machine has) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
ARCH := $(shell uname -m)
# PyTorch builds that install from this class of machine's local wheel cache; override on others.
ifeq ($(ARCH),aarch64)
TORCH_SPEC ?= torch==2.9.1 torchvision==0.24.1
else
TORCH_SPEC ?= torch==2.14.1 torchvision==0.29.1
endif
EXTRAS ?= dev,onnx,openvino,tune,characterize,serve,report,train,cluster,litert,hf

.PHONY: demo test lint typecheck unit-tests install clean perf-analyzer browser triton

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q -e '.[$(EXTRAS)]'
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/infermux units
	$(VENV)/bin/infermux bench --model mobilenet_v3_small --units auto --engine auto --batch 1,8 \
		--min-duration 3s --min-queries 256 --db demo.db
	$(VENV)/bin/infermux tune --model mobilenet_v3_small --units auto --batch 1,4,16,64 \
		--budget 90s --db demo.db --out demo-plan.yaml
	$(VENV)/bin/infermux report last:2 --db demo.db -o demo-report.html

lint: install
	$(VENV)/bin/ruff check src tests bench

typecheck: install
	$(VENV)/bin/mypy

# Headless Chromium (Debian's package) for the report's browser tests; where it is missing and
# apt-get is not there (or fails), those tests skip and say why.
browser:
	@command -v chromium >/dev/null 2>&1 || ! command -v apt-get >/dev/null 2>&1 \
		|| (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium) \
		|| echo "chromium could not be installed: the report's browser tests will skip"

# Triton's server and Python backend for `serve --front triton`: the nvidia-pytriton wheel
# without its dependencies (infermux never imports pytriton; its numpy<2 pin would downgrade
# numpy under torch). It needs Linux x86-64 with glibc 2.35+; elsewhere those tests skip.
# A numpy<2 folder of its own is what `serve --triton-python-path` gives the model instances.
triton: install
	@$(PY) -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('pytriton') is None)" \
		|| $(PY) -m pip install -q --no-deps nvidia-pytriton==0.7.0 \
		|| echo "nvidia-pytriton could not be installed: the --front triton tests will skip"
	@test -d $(VENV)/opt/triton-numpy1/numpy \
		|| $(PY) -m pip install -q --no-deps --target $(VENV)/opt/triton-numpy1 'numpy<2' \
		|| echo "numpy<2 could not be installed: the --triton-python-path tests will skip"

# Two test processes, one module each at a time (a module's fixtures, e.g. a served process,
# start once): most tests hold less than a core for much of their time, so two at once use
# the second core. Tests that assert on timing or on processes coming and going (marked
# `exclusive`) then run alone, in a serial pass. TEST_WORKERS=0 runs everything in one process.
TEST_WORKERS ?= 2
PYTEST := $(VENV)/bin/pytest -q
PARALLEL_PASS := $(PYTEST) --durations=20 -n $(TEST_WORKERS) --dist loadfile -m "not exclusive"
SERIAL_PASS := $(PYTEST) --durations=10 -m exclusive
unit-tests: install browser triton
ifeq ($(TEST_WORKERS),0)
	$(PYTEST) --durations=25
else
	$(PARALLEL_PASS); parallel=$$?; \
	$(SERIAL_PASS); serial=$$?; \
	test $$parallel -eq 0 && test $$serial -eq 0
endif

test: lint typecheck unit-tests

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache demo.db demo-plan.yaml demo-report.html

# Triton's perf_analyzer, for benchmarking `infermux serve`. Its own wheels need glibc 2.38; the
# manylinux wheel of tritonclient 2.48.0 ships a binary that runs on glibc 2.36 given libb64
# (apt) and the CUDA runtime library (a pip wheel). Both libraries are copied beside it
# ($(PA_DIR)/lib), so the folder also runs on a machine without them;
# $(VENV)/bin/perf_analyzer is a wrapper that puts lib/ on LD_LIBRARY_PATH.
PA_DIR := $(VENV)/opt/perf_analyzer
PA_WHEELS := $(VENV)/opt/perf_analyzer-wheels
perf-analyzer: install
	@test -e /usr/lib/x86_64-linux-gnu/libb64.so.0d || apt-get install -y libb64-0d \
		|| (apt-get update && apt-get install -y libb64-0d) \
		|| (echo "install libb64-0d (Debian/Ubuntu) as root, then run make perf-analyzer again" && false)
	mkdir -p $(PA_DIR)/lib
	$(PY) -m pip download -q --no-deps --only-binary=:all: --platform manylinux1_x86_64 \
		--python-version 3.11 tritonclient==2.48.0 -d $(PA_WHEELS)
	$(PY) -m pip download -q --no-deps --only-binary=:all: --platform manylinux2014_x86_64 \
		--python-version 3.11 nvidia-cuda-runtime-cu12 -d $(PA_WHEELS)
	unzip -o -q -j $(PA_WHEELS)/tritonclient-2.48.0-*.whl -d $(PA_DIR) \
		'tritonclient-2.48.0.data/data/bin/perf_analyzer' && chmod +x $(PA_DIR)/perf_analyzer
	unzip -o -q -j $(PA_WHEELS)/nvidia_cuda_runtime_cu12-*.whl \
		'nvidia/cuda_runtime/lib/libcudart.so.12' -d $(PA_DIR)/lib
	cp -L /usr/lib/x86_64-linux-gnu/libb64.so.0d $(PA_DIR)/lib/
	printf '#!/bin/sh\nD="$$(dirname "$$(readlink -f "$$0")")/../opt/perf_analyzer"\nLD_LIBRARY_PATH="$$D/lib:$$LD_LIBRARY_PATH" exec "$$D/perf_analyzer" "$$@"\n' \
		> $(VENV)/bin/perf_analyzer
	chmod +x $(VENV)/bin/perf_analyzer
	$(VENV)/bin/perf_analyzer --version
