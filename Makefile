# Entry points; each installs what it needs into .venv first:
#   make demo       run examples/quickstart.py end to end
#   make test       the test suite (what .ci/run runs): two workers, the ten slowest at the end
#   make test-all   the same with the slow trials too (repeated failovers; a nightly run)
#   make test-fast  pure and single-daemon tests, for daily work (no rings, no programs)
#   make test-oldest  the fast tests on the oldest supported JAX, Flax and Orbax
#   make soak       the save path struck anywhere for 30 minutes, every resume judged
#                   (tests/soak.py; SOAK_ARGS="--minutes 5 --seed 7"; not in make test)
#   make stress     the fault-prone tests 10 times each beside a CPU hog on every core
#                   (STRESS_RUNS=N, STRESS_ARGS="--runs 3 tests/x.py::test_y")
# The newest JAX needs Python >= 3.12: the first of python3.12, python3.13 (on the PATH or
# under pyenv) that runs, else python3 (3.10 or 3.11: the newest JAX for it, 0.10).
PYTHON ?= $(shell for c in python3.12 python3.13 \
	$$(ls -d $${PYENV_ROOT:-$$HOME/.pyenv}/versions/3.1[2-9]*/bin/python 2>/dev/null) python3; \
	do $$c -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null && { echo $$c; break; }; \
	done)
PYTHON := $(or $(PYTHON),python3)
VENV := .venv
INSTALLED := $(VENV)/.installed
# Tests that wait on daemon processes run side by side; the heaviest programs (examples,
# benchmarks: both cores busy) one at a time, in one worker (tests/conftest.py).
PYTEST := $(VENV)/bin/python -m pytest -n 2 --durations=10

$(INSTALLED): pyproject.toml
	$(PYTHON) -m venv --clear $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -m pip install --quiet -e ".[dev]"
	touch $(INSTALLED)

# The oldest supported set (constraints/oldest.txt) in a venv of its own, on python3.
OLDEST := .venv-oldest
$(OLDEST)/.installed: pyproject.toml constraints/oldest.txt
	python3 -m venv --clear $(OLDEST)
	$(OLDEST)/bin/python -m pip install --quiet --upgrade pip
	$(OLDEST)/bin/python -m pip install --quiet -e ".[dev]" -c constraints/oldest.txt
	touch $@

.PHONY: demo test test-all test-fast test-oldest stress soak install
install: $(INSTALLED)

demo: $(INSTALLED)
	$(VENV)/bin/python examples/quickstart.py

test: $(INSTALLED)
	$(PYTEST)

test-all: $(INSTALLED)
	$(PYTEST) --all

test-fast: $(INSTALLED)
	$(PYTEST) -m "not ring and not program"

test-oldest: $(OLDEST)/.installed
	$(OLDEST)/bin/python -m pytest -n 2 -m "not ring and not program"

soak: $(INSTALLED)
	$(VENV)/bin/python -m tests.soak $(SOAK_ARGS)

stress: $(INSTALLED)
	$(VENV)/bin/python -m tests.stress $(STRESS_ARGS)
