# Bootstraps .venv from python3 alone, then runs the main job or the tests.
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: run test lint venv clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/python experiments/gsm8k.py $(ARGS)

test: $(STAMP)
	$(VENV)/bin/python -m pytest tests $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check specroll_jax pallas_kernels experiments tests
