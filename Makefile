# `make test` and `make demo` create .venv when it is missing and install attnlab (editable, with test extras).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.attnlab-installed

.PHONY: test test-fast demo bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet --no-compile -e '.[test]'
	@# bytecode on every core: pip compiles one file at a time (70 of its 150 s on 2 cores); a few files in the
	@# dependencies are not Python 3 (pip skips them too), hence the status ignored
	$(BIN)/python -m compileall -qq -j 0 $(VENV)/lib || true
	touch $(STAMP)

# bytecode cached in __pycache__ even where the environment says not to: the suite starts ~100 interpreters (its
# workers, the processes tests kill or time), each of which would otherwise compile attnlab and the tests again
export PYTHONDONTWRITEBYTECODE :=

# pytest-xdist: two worker processes (TEST_WORKERS=0 runs in this one); most slow tests wait on subprocesses
TEST_WORKERS ?= 2

test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS)

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) -m "not slow"

demo: $(STAMP)
	$(BIN)/attnlab compare --preset demo

bench: $(STAMP)
	$(BIN)/python benchmarks/ns_overhead.py

clean:
	rm -rf runs/demo .pytest_cache .hypothesis
