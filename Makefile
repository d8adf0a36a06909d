# Two commands set up a fresh machine: `make demo` and `make test`. Both create .venv on first use.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup test test-fast lint demo bench serve clean

setup: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	@# mooncake's non-CUDA build (HiSparse PD on CPU) loads the OS library libibverbs.so.1 even for TCP.
	@ldconfig -p | grep -q libibverbs.so.1 || { if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "installing the OS package libibverbs1 (mooncake needs it)"; \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 >/dev/null; } \
	  || echo "warning: could not install libibverbs1: the HiSparse live test will skip"; \
	else echo "note: libibverbs1 is missing and this is not root: the HiSparse live test will skip" \
	  "(install it with: sudo apt-get install libibverbs1)"; fi; }
	$(BIN)/pip install -q -r requirements.txt
	$(BIN)/pip install -q --no-deps -e .
	@# the loopback-bind shim the launch scripts preload for Mooncake (built here once; else at the first launch)
	@out="$$($(BIN)/python -m flashmemory.serve.loopback)" || echo "warning: $$out"
	@touch $(STAMP)

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest -q -rs -n 2 --durations=15 tests

# The suite without real sglang servers (marker `live`: tests/sglang/live) and the `slow` end-to-end runs.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -rs -n 2 -m "not live and not slow" --durations=10 tests

# ruff with pyproject.toml's [tool.ruff]: lint, and the formatter's check (it changes no file).
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

demo: $(STAMP)
	$(BIN)/flashmemory demo --serve

serve: $(STAMP)
	$(BIN)/flashmemory serve

bench: $(STAMP)
	$(BIN)/flashmemory bench all --quick

clean:
	rm -rf $(VENV) demo_out demo_out_quick bench_out serve_logs .pytest_cache
