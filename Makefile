# The README's two commands are `make demo` and `make check`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: venv demo check lint types test test-fast openapi screenshots bench bench-quick gpu-check sim clean

DEMO_STAMP := $(VENV)/.installed-runtime

# Everything: the runtime, torch and the test toolchain (it holds the demo's too).
$(STAMP): pyproject.toml requirements.txt requirements-dev.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -r requirements-dev.txt
	$(BIN)/pip install -q --disable-pip-version-check --no-deps -e .
	touch $(STAMP) $(DEMO_STAMP)

# Only what the demo runs: elasticd's runtime and torch, with pip's progress shown.
$(DEMO_STAMP): pyproject.toml requirements.txt
	$(PY) -m venv $(VENV)
	@echo "== installing elasticd's runtime and torch into $(VENV) (requirements.txt)"
	$(BIN)/pip install --disable-pip-version-check --progress-bar on -r requirements.txt
	$(BIN)/pip install --disable-pip-version-check --no-deps -e .
	touch $(DEMO_STAMP)

venv: $(STAMP)

## demo: start a daemon, submit a 2-worker gloo job whose rank 1 crashes once, show the restart and the success
demo: $(DEMO_STAMP)
	$(BIN)/python examples/demo.py

## check: what CI runs — lint, types, the whole test suite
check: lint types test

lint: $(STAMP)
	$(BIN)/ruff check elasticd api tests bench examples
	$(BIN)/ruff format --check elasticd api tests bench examples

types: $(STAMP)
	$(BIN)/mypy

## screenshots: the browser tests of cancel, a failed job's stderr and the attempt picker rewrite docs/dashboard-{cancelled,failed-stderr,attempt-picker}.png
screenshots: $(STAMP)
	ELASTICD_DOCS_SCREENSHOTS=docs $(BIN)/pytest -q tests/observability/test_dashboard.py \
		-k "cancel_the_grid or failed_jobs_log_pane or attempt_picker"

test: $(STAMP)
	$(BIN)/pytest -q

test-fast: $(STAMP)
	$(BIN)/pytest -q -m "not slow"

## sim: a long sweep of the seeded simulation (tests/sim): SEEDS schedules of each part from
## seed FROM, STEPS fault steps each, JOBS processes; a violation prints its seed and trace, and
## `python -m tests.sim --part P --seed N` replays it (CI runs a bounded sweep in `make test`)
SEEDS ?= 10000
FROM  ?= 0
STEPS ?= 300
JOBS  ?= 2
sim: $(STAMP)
	PYTHONPATH=. $(BIN)/python -m tests.sim --part rendezvous --seeds $(SEEDS) --from $(FROM) --steps $(STEPS) --jobs $(JOBS)
	PYTHONPATH=. $(BIN)/python -m tests.sim --part fleet --seeds $(SEEDS) --from $(FROM) --steps $(STEPS) --jobs $(JOBS)

## openapi: regenerate openapi.json from the app
openapi: $(STAMP)
	$(BIN)/python -m api.openapi > openapi.json

bench: $(STAMP)
	$(BIN)/python bench/run_all.py

comma := ,
#: The scale figure's backends: etcd when it is installed.
SCALE_BACKENDS ?= embedded,http$(if $(shell command -v etcd 2>/dev/null),$(comma)etcd)

## bench-quick: issue 16's figures in a few minutes: the restart (crash -> every replacement's
## first statement, 1 / 2 / 4 nodes, elasticd and torchrun in one run), then the rendezvous scale
## figure at 300 / 1,000 / 3,000 nodes, first round and re-rendezvous, every backend
## (the full figures are in docs/benchmarks.md)
bench-quick: $(STAMP)
	$(BIN)/python bench/bench_restart.py --quick
	$(BIN)/python bench/bench_rendezvous_scale.py --quick --sizes 300,1000,3000 --budget 60 --backends $(SCALE_BACKENDS)
	$(BIN)/python bench/bench_rendezvous_scale.py --quick --sizes 300,1000,3000 --budget 60 --backends $(SCALE_BACKENDS) --restart

## gpu-check: every check that needs an NVIDIA GPU, in one run (bench/gpu_check.py): the GPU
## health check on the real nvidia-smi, CUDA_VISIBLE_DEVICES per job, an NCCL all-reduce job
## with a crash and restart, re-exec and prewarm under NCCL, the flight recorder naming the rank
## behind in an NCCL hang. Without a GPU: "no GPU: skipped", exit 0 (GPU_CHECK_FLAGS=--require-gpu: 77)
gpu-check: $(STAMP)
	$(BIN)/python bench/gpu_check.py $(GPU_CHECK_FLAGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache *.egg-info
