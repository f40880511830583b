# Two commands for a fresh machine: `make train` and `make test`. Both create .venv once and
# reinstall only when pyproject.toml changes (the stamp file records the last install).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
CONFIG ?= configs/grpo_arithmetic.py
ARGS   ?=

.PHONY: train test install install-test clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(PY)
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.installed-test: pyproject.toml $(VENV)/.installed
	$(PY) -m pip install -q -e '.[test]'
	touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

train: $(VENV)/.installed
	$(VENV)/bin/jaxrl train $(CONFIG) $(ARGS)

test: $(VENV)/.installed-test
	$(PY) -m pytest -n 2 tests

clean:
	rm -rf $(VENV) runs
