# Two commands for a fresh machine: `make train` and `make test`. Both create .venv once and
# reinstall only when pyproject.toml changes (the stamp file records the last install).
# The inner loop: `make test-fast` (no child processes, no training runs) and `make lint`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
CONFIG ?= configs/grpo_arithmetic.py
ARGS   ?=

.PHONY: train test test-fast lint format install install-test clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(PY)
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.installed-test: pyproject.toml $(VENV)/.installed
	$(PY) -m pip install -q -e '.[test]'
	touch $@

# pyright resolves the optional imports too (hf: tokenizers, jinja2)
$(VENV)/.installed-lint: pyproject.toml $(VENV)/.installed
	$(PY) -m pip install -q -e '.[lint,hf]'
	touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

train: $(VENV)/.installed
	$(VENV)/bin/jaxrl train $(CONFIG) $(ARGS)

# A test whose worker process dies (a segfault or abort inside a native library) runs once more in a
# fresh worker; pytest-rerunfailures reschedules crashes whatever --only-rerun says, and the pattern
# below matches no Python error, so an ordinary failure is never retried. Reruns are listed (-rR).
CRASH_RERUN := --reruns 1 --only-rerun '^a worker crash$$' -rfER

test: $(VENV)/.installed-test
	$(PY) -m pytest -n 2 --dist worksteal --durations=15 $(CRASH_RERUN) tests

test-fast: $(VENV)/.installed-test
	$(PY) -m pytest -n 2 --dist worksteal -m "not slow" $(CRASH_RERUN) tests

lint: $(VENV)/.installed-lint
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/pyright

format: $(VENV)/.installed-lint
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean:
	rm -rf $(VENV) runs
