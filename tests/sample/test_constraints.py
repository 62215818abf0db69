"""The logits-constraint seam (sample/constraints.py): every kind of constraint through
``LogitsConstraints``, against the pure reference functions of sample/logits_processors.py and
against a grammar advanced by hand."""

from __future__ import annotations

import random

import pytest
import torch

from pagedllm.sample.constraints import (
    AllowedTokenIds,
    BadWords,
    ConstraintRows,
    LogitBias,
    LogitsConstraints,
)
from pagedllm.sample.logits_processors import apply_allowed_token_ids, apply_bad_words, apply_logit_bias
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams
from pagedllm.structured_output import GrammarBatch, StructuredOutputGrammar, StructuredOutputManager, native
from pagedllm.worker.request_logits import GrammarConstraint

VOCAB = 50


def _rows(params: list[SamplingParams], outputs: list[list[int]], reads: list | None = None):
    """The rows of ``params`` whose outputs so far are ``outputs``; ``reads`` records each
    (row, start) the constraints read."""

    def output_token_ids(i: int, start: int) -> list[int]:
        if reads is not None:
            reads.append((i, start))
        return outputs[i][start:]

    return ConstraintRows(
        list(range(len(params))), params, output_token_ids, [len(output) for output in outputs]
    )


def _random_params(rng: random.Random) -> SamplingParams:
    allowed = rng.sample(range(VOCAB), rng.randint(5, VOCAB))
    bias = {rng.randrange(VOCAB): rng.uniform(-5, 5) for _ in range(3)}
    params = SamplingParams(
        allowed_token_ids=allowed if rng.random() < 0.5 else None,
        logit_bias=bias if rng.random() < 0.5 else None,
    )
    if rng.random() < 0.5:  # set by the engine's validation, from bad_words
        params.bad_words_token_ids = [[rng.randrange(VOCAB)], [rng.randrange(VOCAB), rng.randrange(VOCAB)]]
    return params


@pytest.mark.parametrize("seed", range(6))
def test_each_kind_through_the_seam_equals_its_reference(seed):
    """Allowed tokens, logit bias and bad words, each alone and all together, in a batch of rows
    with and without them: the seam leaves the logits as the references applied in that order,
    gives no bitmask, and reads the output only of rows with bad words."""
    rng = random.Random(seed)
    num_rows = 6
    params = [_random_params(rng) for _ in range(num_rows)]
    outputs = [[rng.randrange(VOCAB) for _ in range(rng.randint(0, 4))] for _ in range(num_rows)]
    for row in range(0, num_rows, 3):  # some rows end in the first token of a two-token bad word
        if params[row].bad_words_token_ids:
            outputs[row].append(params[row].bad_words_token_ids[1][0])
    logits = torch.randn((num_rows, VOCAB), generator=torch.Generator().manual_seed(seed))
    bad_words = [p.bad_words_token_ids for p in params]
    past = [output if words else () for output, words in zip(outputs, bad_words)]
    with_bad_words = {i for i, words in enumerate(bad_words) if words}
    references = {
        AllowedTokenIds: lambda x: apply_allowed_token_ids(x, [p.allowed_token_ids for p in params]),
        LogitBias: lambda x: apply_logit_bias(x, [p.logit_bias for p in params]),
        BadWords: lambda x: apply_bad_words(x, bad_words, past),
    }
    for kinds in ([AllowedTokenIds], [LogitBias], [BadWords], [AllowedTokenIds, LogitBias, BadWords]):
        ours, expected = logits.clone(), logits.clone()
        reads: list = []
        seam = LogitsConstraints([kind() for kind in kinds])
        assert seam.before_sampling(ours, _rows(params, outputs, reads)) is None
        for kind in kinds:
            references[kind](expected)
        torch.testing.assert_close(ours, expected, rtol=0, atol=0)
        assert {i for i, _ in reads} == (with_bad_words if BadWords in kinds else set())
        seam.after_launch(torch.zeros(num_rows, dtype=torch.int64), [])  # nothing to do after the launch


@pytest.fixture(scope="module", params=["native", "llmatcher"])
def matcher_kind(request) -> str:
    if request.param == "native" and not native.available():
        pytest.skip("the grammar extension does not build here")
    return request.param


@pytest.fixture(scope="module")
def manager(matcher_kind, smollm2_tokenizer):
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(native, "available", lambda: matcher_kind == "native")
        manager = StructuredOutputManager(smollm2_tokenizer, 49152, [smollm2_tokenizer.eos_token_id])
        manager._grammar_tokenizer()  # which kind of matcher it compiles is decided here
    yield manager
    manager.shutdown()


@pytest.mark.parametrize("fill_ahead", [False, True])
def test_a_grammar_through_the_seam_gives_the_bitmask_of_its_grammar_advanced_by_hand(
    manager, matcher_kind, smollm2_tokenizer, fill_ahead
):
    """Rows with a grammar, with logit bias, with both, and plain: over a few steps the seam
    edits the biased rows, and gives each grammar row the mask of a grammar advanced by hand over
    the row's output (all ones for the others); with ``fill_ahead`` the masks are made ahead
    from the samples (the grammar extension's thread), with the same result."""
    if fill_ahead and matcher_kind != "native":
        pytest.skip("masks are made ahead by the grammar extension's matchers only")
    structured = StructuredOutputsParams(choice=["alpha beta gamma delta", "epsilon"])
    compiled = manager.compile(structured).result(timeout=60)
    with pytest.MonkeyPatch.context() as patch:  # fill_ahead is off where the extension is not in use
        patch.setattr(native, "available", lambda: True)
        grammars = GrammarConstraint(lambda _: compiled, fill_ahead=fill_ahead)
    seam = LogitsConstraints([LogitBias(), grammars])
    bias = {smollm2_tokenizer.eos_token_id: 2.0}
    params = [
        SamplingParams(structured_outputs=structured),
        SamplingParams(logit_bias=bias),
        SamplingParams(structured_outputs=structured, logit_bias=bias),
        SamplingParams(),
    ]
    for p in params:
        if p.structured_outputs is not None:
            p.structured_outputs.compiled_grammar = compiled
    by_hand = {0: StructuredOutputGrammar(compiled), 2: StructuredOutputGrammar(compiled)}
    outputs: list[list[int]] = [[] for _ in params]
    text = smollm2_tokenizer("alpha beta gamma delta", add_special_tokens=False)["input_ids"]
    for step in range(len(text)):
        logits = torch.zeros((len(params), manager.vocab_size))
        bitmask = seam.before_sampling(logits, _rows(params, outputs))
        expected = GrammarBatch().bitmask([by_hand.get(row) for row in range(4)], manager.vocab_size)
        assert bitmask is not None and torch.equal(bitmask, expected), step
        assert logits[1, smollm2_tokenizer.eos_token_id] == logits[2, smollm2_tokenizer.eos_token_id] == 2.0
        samples = torch.tensor([text[step], 7, text[step], 7])
        seam.after_launch(samples, [(row, len(outputs[row]), row) for row in range(len(params))])
        for row, output in enumerate(outputs):
            output.append(int(samples[row]))
        for grammar in by_hand.values():
            assert grammar.accept_tokens([text[step]])
    grammars.drop(range(len(params)))
