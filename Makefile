# Entry points; each installs what it needs into .venv first:
#   make demo       run examples/quickstart.py end to end
#   make test       the test suite (what .ci/run runs): two workers, the ten slowest at the end
#   make test-all   the same with the slow trials too (repeated failovers; a nightly run)
#   make test-fast  pure and single-daemon tests, for daily work (no rings, no programs)
#   make stress     the fault-prone tests 10 times each beside a CPU hog on every core
#                   (STRESS_RUNS=N, STRESS_ARGS="--runs 3 tests/x.py::test_y")
PYTHON ?= python3
VENV := .venv
INSTALLED := $(VENV)/.installed
# Tests that wait on daemon processes run side by side; the heaviest programs (examples,
# benchmarks: both cores busy) one at a time, in one worker (tests/conftest.py).
PYTEST := $(VENV)/bin/python -m pytest -n 2 --durations=10

$(INSTALLED): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -m pip install --quiet -e ".[dev]"
	touch $(INSTALLED)

.PHONY: demo test test-all test-fast stress install
install: $(INSTALLED)

demo: $(INSTALLED)
	$(VENV)/bin/python examples/quickstart.py

test: $(INSTALLED)
	$(PYTEST)

test-all: $(INSTALLED)
	$(PYTEST) --all

test-fast: $(INSTALLED)
	$(PYTEST) -m "not ring and not program"

stress: $(INSTALLED)
	$(VENV)/bin/python -m tests.stress $(STRESS_ARGS)
