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

# Two pytest workers (pytest-xdist), each test file whole on one of them (its module fixtures run
# once): the spawned-rank tests leave a core idle part of the time. Files are handed out in collection
# order (--no-loadscope-reorder), which tests/conftest.py starts with the longest files (LONGEST_FIRST),
# so no long file is left for the end. 981 tests: 595 s in one process, 418 s in two on the 2-core box
# (benchmarks/2026-12-04-suite-time.md); 1205 tests: 645.6 s on a fresh clone, then an estimated (not
# measured) 600-630 s after benchmarks/2026-12-06-suite-time-2.md's cuts. TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2

test: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# The fast tier: tests marked `fast` by tests/conftest.py (no process group, no spawned ranks).
test-fast: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -p no:cacheprovider -m fast

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
