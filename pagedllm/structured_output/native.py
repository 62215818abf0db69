"""llguidance's matchers through its C API, and the thread that makes a step's next masks ahead,
from pagedllm's grammar extension (``csrc/grammar_ext.cpp``), built on first use.

The extension calls the C API that llguidance's own Python extension exports, so matchers and the
ahead thread run without Python: no GIL to take back between calls (a Python thread doing the
same work stalled the thread that launches the steps, ~20 us per handoff, several a step). Its
``Matcher`` has the method names of llguidance's ``LLMatcher`` that ``StructuredOutputGrammar``
calls, so either stands behind a request's grammar.

One difference: the extension's tokenizer is llguidance's view of the vocabulary's bytes without
a tokenize function (which would be Python), so a mask allows every split of bytes the grammar
forces, where ``LLMatcher`` over a Hugging Face tokenizer allows only the canonical one (as
xgrammar's masks do). Every output is in the grammar either way.

Where the extension cannot be built (no compiler), or with ``PAGEDLLM_NATIVE_GRAMMAR=0``,
``available()`` is False: grammars then use ``LLMatcher`` and masks are filled in the step.
"""

from __future__ import annotations

import copy
import functools
import logging
import os
from pathlib import Path
from types import ModuleType

import llguidance._lib

from pagedllm.kernels.cpu.build import build_extension, cache_dir
from pagedllm.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
EXTENSION_NAME = "pagedllm_grammar_ext"
# No -march=native: nothing here is vectorised; the masks are llguidance's.
CXX_FLAGS = ("-O2",)
# How long the ahead thread waits for a step's samples before giving up (a step that failed).
SAMPLES_TIMEOUT_S = 60.0


@functools.cache
def load() -> ModuleType:
    module = build_extension(
        EXTENSION_NAME,
        CSRC,
        ("grammar_ext.cpp",),
        CXX_FLAGS,
        python_module=True,
        description="pagedllm's grammar extension",
    )
    assert module is not None
    return module


def is_built() -> bool:
    """Whether this machine's cache holds the built extension (loading it takes milliseconds)."""
    return (cache_dir(CSRC, CXX_FLAGS) / f"{EXTENSION_NAME}.so").exists()


@functools.cache
def available() -> bool:
    """Whether the extension loads here (building it on the first call); logs why not, once."""
    if os.environ.get("PAGEDLLM_NATIVE_GRAMMAR", "1") == "0":
        return False
    try:
        load()
    except Exception as e:  # no compiler, a failed build: LLMatcher computes the same outputs
        logger.warning("pagedllm's grammar extension is unavailable (%s); using llguidance's Python API", e)
        return False
    return True


def new_tokenizer(tokenizer: Tokenizer, vocab_size: int, stop_token_ids: list[int]) -> object:
    """The extension's llguidance tokenizer for a fast Hugging Face tokenizer (its JSON, as
    ``llguidance.hf.from_tokenizer`` reads it)."""
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError("structured outputs need a fast (Rust) Hugging Face tokenizer for this model")
    backend = copy.copy(tokenizer.backend_tokenizer)
    backend.no_padding()
    backend.no_truncation()
    return load().Tokenizer(llguidance._lib.__file__, backend.to_str(), vocab_size, stop_token_ids)
