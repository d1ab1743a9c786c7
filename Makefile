# Two commands take a fresh clone to a result:
#   make demo   — the service and a 2-process worker tune the demo model, then time its whole step
#   make test   — the test suite (the slowest cases, marked `slow`, run in CI: make test-slow)
# Both create .venv from pyproject.toml on first use.  CI also runs two more environments:
#   make test-oldest   — the ops' and discovery's tests on the oldest JAX cmtune supports (.venv-oldest)
#   make test-maxtext  — the MaxText tier in Python 3.12 with maxtext[tpu] (.venv-maxtext, ~3 GB)

# The newest JAX needs Python 3.12 or newer: the first such interpreter found (pyenv's too), else python3
# (Python 3.11 gets the oldest supported JAX line).  PYTHON=... chooses.
find_python = $(firstword $(foreach v,$(1),$(shell command -v python$(v) >/dev/null 2>&1 && python$(v) -c '' \
	2>/dev/null && command -v python$(v))) $(foreach v,$(1),$(shell pyenv root >/dev/null 2>&1 && \
	for d in "$$(pyenv root)"/versions/$(v).*/bin/python; do [ -x "$$d" ] && echo "$$d"; done | sort -V | tail -1)))
PYTHON ?= $(or $(call find_python,3.12 3.13),python3)
PYTHON_OLDEST ?= $(or $(call find_python,3.11),python3)
PYTHON_MAXTEXT ?= $(call find_python,3.12)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# the oldest JAX the suite is run on (docs/dependencies.md): pyproject.toml's lower bound
OLDEST_JAX := 0.10.2
MAXTEXT := maxtext[tpu]==0.2.5

.PHONY: demo test test-slow test-oldest test-maxtext bench lint clean

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
	$(BIN)/pytest -q -m "not slow and not maxtext" $(PYTEST_ARGS)

test-slow: $(STAMP)
	$(BIN)/pytest -q -m "slow and not maxtext" $(PYTEST_ARGS)

.venv-oldest/.installed: pyproject.toml
	$(PYTHON_OLDEST) -m venv .venv-oldest
	.venv-oldest/bin/pip install --quiet --upgrade pip
	PYTHONWARNINGS='ignore:Editable installation' .venv-oldest/bin/pip install --quiet -e '.[all,dev,tpu]' \
		'jax[tpu]==$(OLDEST_JAX)' 'jaxlib==$(OLDEST_JAX)'
	touch $@

test-oldest: .venv-oldest/.installed
	.venv-oldest/bin/pytest -q -m "not slow and not maxtext" tests/collective_matmul $(PYTEST_ARGS)

# without Python 3.12 the MaxText tests run in .venv and skip, saying how to get it
.venv-maxtext/.installed: pyproject.toml
	@if [ -z "$(PYTHON_MAXTEXT)" ]; then echo "no Python 3.12 found: the MaxText tests will skip (install Python 3.12, e.g. pyenv install 3.12)"; \
	else $(PYTHON_MAXTEXT) -m venv .venv-maxtext && .venv-maxtext/bin/pip install --quiet --upgrade pip && \
	PYTHONWARNINGS='ignore:Editable installation' .venv-maxtext/bin/pip install --quiet -e '.[all,dev,tpu]' '$(MAXTEXT)' && \
	touch $@; fi

test-maxtext: .venv-maxtext/.installed $(STAMP)
	if [ -f .venv-maxtext/.installed ]; then .venv-maxtext/bin/pytest -q -m maxtext $(PYTEST_ARGS); \
	else $(BIN)/pytest -q -m maxtext $(PYTEST_ARGS); fi

bench: $(STAMP)
	$(BIN)/python bench/ops.py

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) .venv-oldest .venv-maxtext .pytest_cache
