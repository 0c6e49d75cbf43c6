# `make test` and `make demo` create .venv when it is missing and install attnlab (editable, with test extras).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.attnlab-installed

.PHONY: test test-fast demo bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

demo: $(STAMP)
	$(BIN)/attnlab compare --preset demo

bench: $(STAMP)
	$(BIN)/python benchmarks/ns_overhead.py

clean:
	rm -rf runs/demo .pytest_cache .hypothesis
