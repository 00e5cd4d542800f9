# Two entry points that work on a fresh machine: `make demo` and `make test`.
# torch is installed first and pinned so that machines without a GPU get the local CPU wheel.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast golden lint architecture-graph venv clean gpu-check aot-compat results results-demo results-bench \
	transformers-suite

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

# A contributor's quick check (README, "Development"): the cache against DynamicCache, the policy against its
# brute-force references, configs, stats and the command line; the whole suite is `make test`.
FAST_TESTS ?= tests/test_cache.py tests/test_policy_unified.py tests/test_policy_budget.py tests/test_config.py \
	tests/test_stats.py tests/test_cli.py tests/test_cli_errors.py
test-fast: $(STAMP)
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(PY) -m pytest -q -n 2 -m "not slow" $(FAST_TESTS)

# Every recorded golden output (tests/golden.py): what each preset generates and holds on torch, the CPU kernel and
# Triton's interpreter; the default suite compares all but the slow Triton cases. Run after every refactoring step.
golden: $(STAMP)
	HFKV_GOLDEN_ALL=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(PY) -m pytest -q -n 2 tests/test_golden_outputs.py

# On a lent GPU machine (docs/kernels.md, "Validating on a GPU"): its python3 with the carried wheels, no venv; from
# the repository root (eval/gpu/check.py imports tests/ and eval/ as packages of this checkout).
# The files go to $OUT (the run tool's output folder) or gpu_check_out; GPU_CHECK_ARGS=--dry-run rehearses on a CPU.
gpu-check:
	$(PYTHON) -m eval.gpu.check --out $${OUT:-gpu_check_out} $(GPU_CHECK_ARGS)

# The GPU image's Triton (3.6) compiles what the venv's does not always: compile every kernel configuration
# with it too, on this CPU machine, before a lease (docs/kernels.md, "Before a lease").
AOT_TRITON ?= triton==3.6.0
aot-compat: $(STAMP)
	$(PY) -m pip install -q --no-deps --target .aot-triton $(AOT_TRITON)
	env -u TRITON_INTERPRET PYTHONPATH=.aot-triton $(PY) -m eval.gpu.aot

# Regenerating the committed results. A plain `hfkv demo/bench/eval` writes under the working directory's hfkv-out/
# (gitignored) and never over eval/results/; these targets write there on purpose, with the arguments the
# committed files record (demo.json's run.options, each bench JSON's args). Speed needs a quiet machine: run one
# at a time, alone (docs/bench.md, "Timing honestly"); the bench commands wait up to 15 min for a quiet one.
results: results-demo results-bench

results-demo: $(STAMP)
	$(VENV)/bin/hfkv demo --no-progress --out eval/results/demo.json

# RESULTS_BENCH: which of eval/results/bench/<name>.json to re-measure (default: all of them, the current figures;
# the snapshots of past commits, *_before, *_observation, *_policy_cpp, *_repeat, *_final, *_session11, are in
# eval/archive/results/bench/ and not re-measured: eval/archive/README.md gives their commands). --force: every group.
RESULTS_BENCH ?= cpu_small_fp32 cpu_small_fp32_prefill cpu_small_fp32_chunked \
	smollm2_bf16_cpu smollm2_bf16_cpu_prefill smollm2_bf16_cpu_chunked
BENCH_RANDOM := --random-like cpu-small --dtype fp32 --methods dynamic evict@1024 hfkv@1024 --budgets "" \
	--contexts 8192 --batch-sizes 1 --decode-steps 16 --prefill-repeats 2 --wait-quiet 900
BENCH_SMOLLM2 := --model smollm2 --dtype bf16 --methods dynamic evict@1024 hfkv@1024 --budgets "" --batch-sizes 1 \
	--warmup 4 --wait-quiet 900
bench_args.cpu_small_fp32 := --random-like cpu-small --dtype fp32 \
	--methods dynamic,static,quanto-int4,evict@1024,quant,hfkv@1024,hfkv@256 --budgets "" \
	--contexts 512,2048,8192 --batch-sizes 1 --decode-steps 32 --prefill-chunk 1024 --wait-quiet 600
bench_args.cpu_small_fp32_prefill := $(BENCH_RANDOM)
bench_args.cpu_small_fp32_chunked := $(BENCH_RANDOM) --prefill-chunk 1024
bench_args.smollm2_bf16_cpu := $(BENCH_SMOLLM2) --contexts 512,8192 --decode-steps 32
bench_args.smollm2_bf16_cpu_prefill := $(BENCH_SMOLLM2) --contexts 8192 --decode-steps 16 --prefill-repeats 2
bench_args.smollm2_bf16_cpu_chunked := $(BENCH_SMOLLM2) --contexts 8192 --decode-steps 16 --prefill-repeats 2 \
	--prefill-chunk 1024

results-bench: $(STAMP)
	$(foreach n,$(RESULTS_BENCH),$(if $(bench_args.$(n)),,$(error RESULTS_BENCH: no arguments recorded for '$(n)'; \
		known: $(patsubst bench_args.%,%,$(filter bench_args.%,$(.VARIABLES))))))
	$(foreach n,$(RESULTS_BENCH),HF_HUB_OFFLINE=1 $(VENV)/bin/hfkv bench $(bench_args.$(n)) --name $(n) \
		--out-dir eval/results/bench --force --no-progress &&) true

# transformers' own cache, generation and model tests (5.23.0's, vendored: eval/transformers_suite/README.md), run as
# they are and with every DynamicCache built as a TriStateCache("full"), then which of the first run's passes still
# pass. Offline, CPU; writes under hfkv-out/transformers_suite/ (gitignored). The test-only packages first.
TRANSFORMERS_SUITE_DEPS ?= parameterized timeout-decorator httpx pytest-timeout
transformers-suite: $(STAMP)
	$(PY) -m pip install -q $(TRANSFORMERS_SUITE_DEPS)
	$(PY) -m eval.transformers_suite.run --preset none
	$(PY) -m eval.transformers_suite.run --preset full
	$(PY) -m eval.transformers_suite.compare hfkv-out/transformers_suite/none.json hfkv-out/transformers_suite/full.json

lint: $(STAMP)
	$(VENV)/bin/ruff check hfkv tests eval configs calibration
	$(VENV)/bin/lint-imports

# docs/architecture.md's import graph of hfkv's parts, drawn from the code (tests/test_import_graph.py checks it)
architecture-graph: $(STAMP)
	$(PY) -m eval.import_graph --write

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .aot-triton
