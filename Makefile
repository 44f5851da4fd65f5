# Bootstraps a virtual environment from python3 alone, then runs the main job or the tests.
#   make run | make test                   Python 3.11 line (jax 0.10), .venv, full test extra
#   make test-all                          make test, then the tests marked slow
#   make test PY=python3.12 VENV=.venv312 EXTRAS=core-test TESTS="tests/test_sampling.py ..."
PY ?= python3
VENV ?= .venv
EXTRAS ?= test
TESTS ?= tests
# the fast suite's pytest workers (pytest-xdist; whole modules per worker, so a module's fixtures
# compile once): its time is mostly single-threaded XLA compilation, so 2 workers on 2 cores take
# it from about 13 to under 8 minutes. WORKERS=0 runs it in one process.
WORKERS ?= 2
STAMP := $(VENV)/.installed-$(EXTRAS)

.PHONY: run test test-slow test-all lint venv

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -e '.[$(EXTRAS)]'
	touch $(STAMP)

venv: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/python experiments/gsm8k.py $(ARGS)

# the fast suite compiles without XLA's CPU backend optimisation passes (tests/conftest.py), in
# $(WORKERS) worker processes
test: $(STAMP)
	SPECROLL_TEST_FAST_COMPILE=1 $(VENV)/bin/python -m pytest $(TESTS) -m "not slow" \
	  -n $(WORKERS) --dist loadfile $(ARGS)

test-slow: $(STAMP)
	$(VENV)/bin/python -m pytest $(TESTS) -m slow $(ARGS)

# everything: the fast suite, then the tests marked slow (CI runs this)
test-all: test test-slow

lint: $(STAMP)
	$(VENV)/bin/ruff check specroll_jax pallas_kernels experiments tests
