# Two commands take a fresh clone to a result:
#   make demo   — the service and a 2-process worker tune the demo model, then time its whole step
#   make test   — the test suite (the slowest cases, marked `slow`, run in CI: make test-slow)
# Both create .venv from pyproject.toml on first use.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-slow bench lint clean

# PYTHONWARNINGS: setuptools' one notice on every editable install of a mapped layout (cmtune.tuner is
# tuner/), that folders named like a package in the working directory may shadow it: here they are its sources
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	PYTHONWARNINGS='ignore:Editable installation' $(BIN)/pip install --quiet -e '.[all,dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/cmtune demo

test: $(STAMP)
	$(BIN)/pytest -q -m "not slow" $(PYTEST_ARGS)

test-slow: $(STAMP)
	$(BIN)/pytest -q -m slow $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/python bench/ops.py

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache
