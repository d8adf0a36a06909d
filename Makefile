# Two commands set up a fresh machine: `make demo` and `make test`. Both create .venv on first use.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup test demo bench serve clean

setup: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q -r requirements.txt
	$(BIN)/pip install -q --no-deps -e .
	@touch $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q --durations=10 tests

demo: $(STAMP)
	$(BIN)/flashmemory demo --serve

serve: $(STAMP)
	$(BIN)/flashmemory serve

bench: $(STAMP)
	$(BIN)/flashmemory bench all --quick

clean:
	rm -rf $(VENV) demo_out demo_out_quick bench_out serve_logs .pytest_cache
