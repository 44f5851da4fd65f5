# Bootstraps a virtual environment from python3 alone, then runs the main job or the tests.
#   make run | make test                   Python 3.11 line (jax 0.10), .venv, full test extra
#   make test-slow                         the tests marked slow but not long (CI runs it)
#   make test-all                          make test, then every test marked slow
#   make test PY=python3.12 VENV=.venv312 EXTRAS=core-test TESTS="tests/test_sampling.py ..."
PY ?= python3
VENV ?= .venv
EXTRAS ?= test
TESTS ?= tests
# pytest workers (pytest-xdist; whole modules per worker, so a module's fixtures compile once):
# the suites' time is mostly single-threaded XLA compilation, so 2 workers on 2 cores take about
# half the time of one. WORKERS=0 runs a suite in one process.
WORKERS ?= 2
# a worker that crashes fails the run at once, naming its test: pytest-xdist's loadfile scheduler
# can deadlock at the end of a run when it replaces a crashed worker (pytest-xdist #784, #1378)
XDIST = $(if $(filter 0,$(WORKERS)),,--max-worker-restart=0)
STAMP := $(VENV)/.installed-$(EXTRAS)

.PHONY: run test test-slow test-long test-all lint venv

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
	  -n $(WORKERS) --dist loadfile $(XDIST) $(ARGS)

# the slow set CI runs: "long" tests (pyproject.toml's markers) wait for test-all
test-slow: $(STAMP)
	$(VENV)/bin/python -m pytest $(TESTS) -m "slow and not long" -n $(WORKERS) --dist loadfile $(XDIST) $(ARGS)

test-long: $(STAMP)
	$(VENV)/bin/python -m pytest $(TESTS) -m long -n $(WORKERS) --dist loadfile $(XDIST) $(ARGS)

# everything: the fast suite, then every test marked slow
test-all: test test-slow test-long

lint: $(STAMP)
	$(VENV)/bin/ruff check specroll_jax pallas_kernels experiments tests
