# One-command set-up: a local .venv with the CPU build of torch installed FIRST (so pip never
# resolves a multi-GB CUDA build), then this package with its test extra.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
STAMP := $(VENV)/.installed

.PHONY: install test test-fast docs train lint clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==$(TORCH_VERSION)
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

# Three pytest workers (pytest-xdist) on the 2-core box, each test file whole on one of them (its module
# fixtures run once): with two, one quiet `make test` used 610 s of CPU (as /usr/bin/time counts it) in 783 s
# of wall time, the cores idle while spawned ranks, subprocesses and checkpoint writes waited; a third worker
# fills that time, a fourth was slower (more ranks than cores: benchmarks/2026-12-06-suite-time-3.md). Files
# are handed out in collection order (--no-loadscope-reorder), longest first (LONGEST_FIRST in
# tests/conftest.py). Bytecode is written even where the environment says not to (PYTHONDONTWRITEBYTECODE):
# every subprocess and spawned rank of the run then loads the package's compiled modules instead of
# compiling them again. TEST_WORKERS=0: one process.
TEST_WORKERS ?= 3

test: $(STAMP)
	OMP_NUM_THREADS=1 PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# The fast tier: tests marked `fast` by tests/conftest.py (no process group, no spawned ranks).
test-fast: $(STAMP)
	OMP_NUM_THREADS=1 PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q -p no:cacheprovider -m fast

# The API reference from the docstrings (pdoc, from the test extra): build/api/index.html. Fails on
# any pdoc warning (tests/unit/test_api_docs.py checks the same in `make test`).
docs: $(STAMP)
	$(PY) -m lightning_hotspa.tools.api_docs build/api

# The embedded default (configs/config.yaml): tiny Llama, strategy=hotspa on 4 CPU processes, the
# bundled stdlib corpus, W&B offline unless WANDB_MODE says otherwise. Fails if the mean loss of the
# last 10 steps is above 0.75x the first step's. Extra Hydra overrides: make train ARGS="model=small".
train: $(STAMP)
	@start=$$(date +%s); \
	OMP_NUM_THREADS=1 WANDB_MODE=$${WANDB_MODE:-offline} $(PY) recipes/train.py expect_loss_ratio=0.75 $(ARGS); \
	status=$$?; echo "make train: $$(( $$(date +%s) - start )) s (exit $$status)"; exit $$status

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info
