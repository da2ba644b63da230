# Kiln's entry points. `make demo` and `make test` each set themselves up on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
KILN_HOME ?= $(CURDIR)/.kiln

.PHONY: setup demo smoke test ui clean

setup: $(VENV)/.installed

# torch is installed first, pinned, by pip: an unpinned torch can pull a multi-GB CUDA build on a CPU machine, and
# pip takes a CPU build where the machine keeps one on disk (its find-links). The rest is installed by uv, which
# keeps that torch (it satisfies the pin) and installs the other ~230 packages in seconds where pip takes minutes.
# --compile-bytecode as pip does: where PYTHONDONTWRITEBYTECODE is set, nothing else would ever write the .pyc files
# and every process would compile dagster, mlflow and ray again (a fresh clone's tests: 23.5 min without it, 14 with).
# The demo needs the package alone; the tests add the `test` extra (transformers, selenium, moto, pytest-xdist, ...).
UV := $(BIN)/uv pip install --python $(BIN)/python --compile-bytecode -q
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0 uv==0.13.8
	$(UV) -e .
	@bash scripts/apt-lists.sh
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(UV) -e '.[test]'
	touch $@

demo: setup
	$(BIN)/kiln run --preset demo --home $(KILN_HOME)

smoke: setup
	$(BIN)/kiln run --preset smoke --home $(KILN_HOME)

# scripts/test-deps.sh installs the Debian packages the tests need (scripts/test-packages.txt) or says how; pytest
# then fails if a test was skipped for a missing one (KILN_ALLOW_SKIPS=1 allows that). The tests run on TEST_WORKERS
# pytest-xdist workers, one file per worker at a time (tests/conftest.py); TEST_WORKERS=0 runs them in one process;
# PYTEST_ARGS adds options (PYTEST_ARGS=-v names each test as it ends).
TEST_WORKERS ?= 2
PYTEST_ARGS ?=
test: $(VENV)/.installed-test
	@bash scripts/test-deps.sh
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --durations=25 $(PYTEST_ARGS)

ui: setup
	DAGSTER_HOME=$(KILN_HOME)/dagster bash scripts/ui.sh $(BIN) $(KILN_HOME)

clean:
	rm -rf $(KILN_HOME)
