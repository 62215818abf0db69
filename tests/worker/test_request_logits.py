"""Grammar masks filled a step ahead (``RequestLogitsProcessors.fill_ahead``) equal masks filled
when the step samples, step after step; rows the thread could not fill (new requests, a history
that moved on) are filled inline; drops wait for the thread."""

from __future__ import annotations

import threading

import pytest
import torch

from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams
from pagedllm.structured_output import GrammarBatch, StructuredOutputManager
from pagedllm.worker.request_logits import RequestLogitsProcessors

VOCAB = 49152
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def params(smollm2_tokenizer) -> SamplingParams:
    manager = StructuredOutputManager(smollm2_tokenizer, VOCAB, [smollm2_tokenizer.eos_token_id])
    structured = StructuredOutputsParams(json=SCHEMA)
    structured.compiled_grammar = manager.compile(structured).result(timeout=60)
    manager.shutdown()
    return SamplingParams(structured_outputs=structured)


@pytest.fixture
def fill_threads(monkeypatch) -> list[tuple[int, str, int]]:
    """(id of the GrammarBatch, thread name, live rows) of every bitmask fill."""
    calls: list[tuple[int, str, int]] = []
    bitmask = GrammarBatch.bitmask

    def recording(self, grammars, vocab_size, out=None):
        live = sum(g is not None and not g.is_terminated() for g in grammars)
        calls.append((id(self), threading.current_thread().name, live))
        return bitmask(self, grammars, vocab_size, out)

    monkeypatch.setattr(GrammarBatch, "bitmask", recording)
    return calls


def _masked(processors: RequestLogitsProcessors, req_ids, params, outputs, seed: int) -> torch.Tensor:
    logits = torch.randn((len(req_ids), VOCAB), generator=torch.Generator().manual_seed(seed))
    processors(logits, req_ids, [params] * len(req_ids), outputs)
    return logits


def test_masks_filled_ahead_equal_masks_filled_inline(params, fill_threads):
    processors = RequestLogitsProcessors()
    req_ids = [3, 5, 8]
    outputs: list[list[int]] = [[], [], []]
    for step in range(24):
        logits = _masked(processors, req_ids, params, outputs, step)
        # A new processor catches up from the whole history: the reference.
        expected = _masked(RequestLogitsProcessors(), req_ids, params, outputs, step)
        assert torch.equal(torch.isinf(logits), torch.isinf(expected)), f"step {step}"
        tokens = logits.argmax(-1).tolist()
        samples = [(req_id, len(outputs[row]), row) for row, req_id in enumerate(req_ids)]
        for row, token in enumerate(tokens):
            outputs[row].append(token)
        processors.fill_ahead(lambda tokens=tokens: tokens, samples)
    # After the first step, every live row came from the thread: the step's own fill had none.
    ours = [(name, live) for batch, name, live in fill_threads if batch == id(processors._grammar_batch)]
    on_thread = [live for name, live in ours if name.startswith("grammar-fill")]
    inline = [live for name, live in ours if not name.startswith("grammar-fill")]
    assert len(on_thread) >= 23 and sum(on_thread) > 0  # the last may still run
    assert inline[0] == 3 and sum(inline[1:]) == 0


def test_a_history_that_moved_on_and_a_new_request_are_filled_inline(params):
    processors = RequestLogitsProcessors()
    outputs = [[]]
    first = _masked(processors, [1], params, outputs, 0).argmax(-1).tolist()
    processors.fill_ahead(lambda: first, [(1, 0, 0)])
    # The thread advanced request 1 by its first token; the host's history has a second one, and
    # request 2 joins.
    second = _masked(RequestLogitsProcessors(), [1], params, [first], 1).argmax(-1).tolist()
    outputs = [first + second, []]
    logits = _masked(processors, [1, 2], params, outputs, 2)
    expected = _masked(RequestLogitsProcessors(), [1, 2], params, outputs, 2)
    assert torch.equal(torch.isinf(logits), torch.isinf(expected))


def test_drops_wait_for_the_fill_ahead(params):
    processors = RequestLogitsProcessors()
    tokens = _masked(processors, [1, 2], params, [[], []], 0).argmax(-1).tolist()
    release = threading.Event()

    def sampled() -> list[int]:
        release.wait(timeout=30)
        return tokens

    processors.fill_ahead(sampled, [(1, 0, 0), (2, 0, 1)])
    processors.drop([1])  # while the thread holds request 1's grammar
    release.set()
    logits = _masked(processors, [2], params, [tokens[1:]], 1)
    expected = _masked(RequestLogitsProcessors(), [2], params, [tokens[1:]], 1)
    assert torch.equal(torch.isinf(logits), torch.isinf(expected))
    assert 1 not in processors._grammars and 2 in processors._grammars
