# Every command of the project has its home here; README and .ci/run call these targets.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test check lint types bench bench-peers clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev,arrow,json,remote,s3,tokenizers,images]'
	$(PY) -m compileall -q roxxel  # an editable install leaves this to the first import
	touch $(STAMP)

# The main job: pack a real corpus every machine has offline, then train on it.
demo: setup
	$(PY) examples/main.py --out runs/demo

test: setup
	$(PY) -m pytest -q

lint: setup
	$(PY) -m ruff check roxxel tests tools benchmarks examples
	$(PY) -m ruff format --check roxxel tests tools benchmarks examples

types: setup
	$(VENV)/bin/pyright

check: lint types test

bench: setup
	$(PY) -m benchmarks.run --quick

bench-peers: setup
	$(PY) -m benchmarks.run --peers --small

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache .hypothesis
