"""Structured outputs: grammars compiled off the critical path, a matcher per request, and the
token bitmask that keeps each row's next token inside its grammar (through llguidance)."""

from pagedllm.structured_output.bitmask import allocate_token_bitmask, apply_token_bitmask, bitmask_words
from pagedllm.structured_output.grammar import (
    AheadResult,
    GrammarAheadWorker,
    GrammarBatch,
    StructuredOutputGrammar,
)
from pagedllm.structured_output.manager import CompiledGrammar, StructuredOutputManager

__all__ = [
    "AheadResult",
    "CompiledGrammar",
    "GrammarAheadWorker",
    "GrammarBatch",
    "StructuredOutputGrammar",
    "StructuredOutputManager",
    "allocate_token_bitmask",
    "apply_token_bitmask",
    "bitmask_words",
]
