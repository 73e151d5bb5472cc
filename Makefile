# zerofit developer entry points. Two commands matter on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
# DeepSpeed JIT-compiles its CPU ops on first use; one stable cache means every run pays that once.
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions
export ZEROFIT_CACHE ?= $(CURDIR)/.cache/zerofit
export DS_ACCELERATOR ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo cuda || echo cpu)

.PHONY: setup test lint format demo clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, so nothing else pulls a multi-GB CUDA build in its place.
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

setup: $(VENV)/.installed

test: setup
	$(PY) -m pytest -q $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

demo: setup
	$(VENV)/bin/zerofit plan --config configs/demo.yaml

clean:
	rm -rf $(VENV) .cache runs .pytest_cache .ruff_cache
