# Two entry points, each installs what it needs into .venv first:
#   make demo   run examples/quickstart.py end to end
#   make test   run the test suite (what .ci/run runs)
PYTHON ?= python3
VENV := .venv
INSTALLED := $(VENV)/.installed

$(INSTALLED): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -m pip install --quiet -e ".[dev]"
	touch $(INSTALLED)

.PHONY: demo test install
install: $(INSTALLED)

demo: $(INSTALLED)
	$(VENV)/bin/python examples/quickstart.py

test: $(INSTALLED)
	$(VENV)/bin/python -m pytest
