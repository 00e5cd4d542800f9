# Two entry points that work on a fresh machine: `make demo` and `make test`.
# torch is installed first and pinned so that machines without a GPU get the local CPU wheel.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: demo test lint venv clean gpu-check aot-compat

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e ".[all]"
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/hfkv demo

test: $(STAMP)
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(PY) -m pytest -q -n 2 tests

# On a lent GPU machine (docs/kernels.md, "Validating on a GPU"): its python3 with the carried wheels, no venv.
# The files go to $OUT (the run tool's output folder) or gpu_check_out; GPU_CHECK_ARGS=--dry-run rehearses on a CPU.
gpu-check:
	$(PYTHON) -m hfkv.kernels.gpu_check --out $${OUT:-gpu_check_out} $(GPU_CHECK_ARGS)

# The GPU image's Triton (3.6) compiles what the venv's does not always: compile every kernel configuration
# with it too, on this CPU machine, before a lease (docs/kernels.md, "Before a lease").
AOT_TRITON ?= triton==3.6.0
aot-compat: $(STAMP)
	$(PY) -m pip install -q --no-deps --target .aot-triton $(AOT_TRITON)
	env -u TRITON_INTERPRET PYTHONPATH=.aot-triton $(PY) -m hfkv.kernels.aot_check

lint: $(STAMP)
	$(VENV)/bin/ruff check hfkv tests eval configs calibration

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .aot-triton
