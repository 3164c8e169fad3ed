# The README's two set-up commands: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: demo test venv

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

venv: $(PY)

# Train the digits example end to end and print where its logs and checkpoint are.
demo: $(PY)
	$(PIP) install -q -e '.[examples,tensorboard]'
	$(PY) examples/digits_mlp.py --log-dir runs/digits_mlp

# Install the dev extras and run the whole test suite (two workers; a test file stays on one).
test: $(PY)
	$(PIP) install -q -e '.[dev]'
	$(PY) -m pytest -n 2 --dist loadfile tests
