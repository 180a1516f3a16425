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
EXTRAS ?= dev,onnx,openvino,tune,characterize

.PHONY: demo test lint typecheck unit-tests install clean

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

lint: install
	$(VENV)/bin/ruff check src tests bench

typecheck: install
	$(VENV)/bin/mypy

unit-tests: install
	$(VENV)/bin/pytest -q

test: lint typecheck unit-tests

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache demo.db demo-plan.yaml
