# The README's two set-up commands: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: demo test venv bench-env bench docs docs-serve smoke-lowest

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

venv: $(PY)

# Train the digits example end to end and print where its logs and checkpoint are (each run in
# its own runs/MLPClassifier/version_N folder, so running it again keeps the earlier runs).
demo: $(PY)
	$(PIP) install -q -e '.[examples,tensorboard]'
	$(PY) examples/digits_mlp.py --base-log-dir runs

# Install the dev extras and run the whole test suite (two workers; a test file stays on one).
test: $(PY)
	$(PIP) install -q -e '.[dev]'
	$(PY) -m pytest -n 2 --dist loadfile tests

# A fit, a resume and a tune trial on the lowest dependency versions pyproject.toml declares
# (tests/lowest-requirements.txt), in a venv of their own.
LOWEST_VENV ?= .venv-lowest
smoke-lowest:
	$(PYTHON) -m venv $(LOWEST_VENV)
	$(LOWEST_VENV)/bin/python -m pip install -q --upgrade pip
	$(LOWEST_VENV)/bin/python -m pip install -q -r tests/lowest-requirements.txt
	$(LOWEST_VENV)/bin/python -m pip install -q --no-deps -e .
	$(LOWEST_VENV)/bin/python -m pip check
	rm -rf $(LOWEST_VENV)-work && $(LOWEST_VENV)/bin/python tests/smoke_lowest.py $(LOWEST_VENV)-work

# The documentation site (site/): the guides in docs/ and the API reference from the docstrings;
# --strict, so a broken link or reference fails the build.
docs: $(PY)
	$(PIP) install -q -e '.[docs]'
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

docs-serve: $(PY)
	$(PIP) install -q -e '.[docs]'
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve

# Benchmarks (benchmarks/*.py) in a separate venv: Keras, the peer that benchmarks/keras_peer.py
# compares with, must not become a dependency of flaxlight.
BENCH_VENV ?= .venv-bench
BENCH_PY := $(BENCH_VENV)/bin/python
BENCH_ARGS ?=
BENCH_SCRIPTS := overhead fused full_featured keras_peer nnx_vs_linen checkpointing scaling

$(BENCH_PY):
	$(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_PY) -m pip install -q --upgrade pip

bench-env: $(BENCH_PY)
	$(BENCH_PY) -m pip install -q -e '.[examples,tensorboard]' keras

# Every benchmark in sequence, each printing its table (BENCH_ARGS=--quick for a smoke run).
bench: bench-env
	@set -e; for script in $(BENCH_SCRIPTS); do \
		echo "=== benchmarks/$$script.py $(BENCH_ARGS)"; \
		$(BENCH_PY) benchmarks/$$script.py $(BENCH_ARGS); \
	done
