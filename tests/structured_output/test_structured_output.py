"""Structured outputs on the embedded model's tokenizer: decoding from random logits through the
bitmask always yields text in the grammar, for every kind of constraint."""

from __future__ import annotations

import json
import re

import jsonschema
import llguidance.hf
import llguidance.numpy
import pytest
import torch

from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured_output import (
    GrammarBatch,
    StructuredOutputGrammar,
    StructuredOutputManager,
    allocate_token_bitmask,
    apply_token_bitmask,
)

MAX_STEPS = 400
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "colour": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
    },
    "required": ["name", "colour", "ok", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def manager(smollm2_tokenizer) -> StructuredOutputManager:
    manager = StructuredOutputManager(smollm2_tokenizer, 49152, [smollm2_tokenizer.eos_token_id])
    yield manager
    manager.shutdown()


def test_grammar_tokenizer_is_built_by_the_first_compilation_once(
    smollm2_tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine serving no constrained request never builds llguidance's tokenizer (30-70 MB of
    resident memory for SmolLM2); concurrent first compilations build it once."""
    built = []
    from_tokenizer = llguidance.hf.from_tokenizer

    def counted(*args, **kwargs):
        built.append(args)
        return from_tokenizer(*args, **kwargs)

    monkeypatch.setattr(llguidance.hf, "from_tokenizer", counted)
    manager = StructuredOutputManager(smollm2_tokenizer, 49152, [smollm2_tokenizer.eos_token_id])
    try:
        assert not built
        futures = [manager.compile(StructuredOutputsParams(regex=f"[a-z]{{{n}}}")) for n in range(1, 5)]
        assert all(future.result(timeout=60).stop_token_ids for future in futures)
        assert len(built) == 1
    finally:
        manager.shutdown()


def _grammar(manager, params: StructuredOutputsParams) -> StructuredOutputGrammar:
    return StructuredOutputGrammar(manager.compile(params).result(timeout=60))


def _bitmask(manager, grammars, out=None) -> torch.Tensor:
    return GrammarBatch().bitmask(grammars, manager.vocab_size, out=out)


def _decode(manager, tokenizer, params: StructuredOutputsParams, seed: int) -> str:
    """Greedy over random logits, masked by the grammar, until it accepts EOS."""
    grammar = _grammar(manager, params)
    generator = torch.Generator().manual_seed(seed)
    token_ids = []
    for _ in range(MAX_STEPS):
        logits = torch.randn((1, manager.vocab_size), generator=generator)
        apply_token_bitmask(logits, _bitmask(manager, [grammar]))
        token_id = int(logits.argmax())
        assert grammar.accept_tokens([token_id])
        if grammar.is_terminated():
            assert token_id == tokenizer.eos_token_id
            return tokenizer.decode(token_ids)
        token_ids.append(token_id)
    pytest.fail(f"no end in {MAX_STEPS} tokens: {tokenizer.decode(token_ids)!r}")


@pytest.mark.parametrize("seed", range(4))
def test_json_schema_output_parses_and_conforms(manager, smollm2_tokenizer, seed):
    text = _decode(manager, smollm2_tokenizer, StructuredOutputsParams(json=SCHEMA), seed)
    jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_accepts_objects_only(manager, smollm2_tokenizer):
    # Random logits would nest objects without end: check what it accepts instead.
    def accepts(text: str) -> bool:
        grammar = _grammar(manager, StructuredOutputsParams(json_object=True))
        ids = smollm2_tokenizer(text, add_special_tokens=False)["input_ids"]
        return grammar.accept_tokens([*ids, smollm2_tokenizer.eos_token_id]) and grammar.is_terminated()

    assert accepts('{"a": [1, 2], "b": {"c": null}}')
    assert not accepts("[1, 2]")
    assert not accepts('{"a": 1')


@pytest.mark.parametrize("seed", range(3))
def test_regex_choice_and_grammar_outputs_match(manager, smollm2_tokenizer, seed):
    regex = r"[a-c]{2,5}-[0-9]{3}"
    assert re.fullmatch(
        regex, _decode(manager, smollm2_tokenizer, StructuredOutputsParams(regex=regex), seed)
    )
    choices = ['say "yes"', "no\\way", "maybe\nso"]
    choice = _decode(manager, smollm2_tokenizer, StructuredOutputsParams(choice=choices), seed)
    assert choice in choices
    grammar = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
    text = _decode(manager, smollm2_tokenizer, StructuredOutputsParams(grammar=grammar), seed)
    assert re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", text)


@pytest.mark.parametrize(
    "params, message",
    [
        (StructuredOutputsParams(json={"type": "nonsense"}), "structured_outputs.json does not compile"),
        (StructuredOutputsParams(regex="(("), "structured_outputs.regex does not compile"),
        (StructuredOutputsParams(grammar="root ::= "), "structured_outputs.grammar does not compile"),
    ],
)
def test_constraints_that_do_not_compile_fail_their_future(manager, params, message):
    with pytest.raises(ValueError, match=message):
        _grammar(manager, params)


def test_same_constraint_compiles_once(manager):
    params = StructuredOutputsParams(regex="[0-9]+x")
    assert manager.compile(params) is manager.compile(StructuredOutputsParams(regex="[0-9]+x"))


def test_rollback_restores_the_mask(manager, smollm2_tokenizer):
    grammar = _grammar(manager, StructuredOutputsParams(choice=["alpha", "beta"]))
    grammar_with_rollback = _grammar(manager, StructuredOutputsParams(choice=["alpha", "beta"]))
    before = _bitmask(manager, [grammar_with_rollback])
    token = smollm2_tokenizer("alpha", add_special_tokens=False)["input_ids"][0]
    assert grammar_with_rollback.accept_tokens([token])
    assert not torch.equal(_bitmask(manager, [grammar_with_rollback]), before)
    grammar_with_rollback.rollback(1)
    assert torch.equal(_bitmask(manager, [grammar_with_rollback]), before)
    # A token outside the grammar is refused.
    assert not grammar.accept_tokens(smollm2_tokenizer("zzz", add_special_tokens=False)["input_ids"][:1])


def test_batch_bitmask_rewrites_every_row_of_a_reused_buffer(manager, smollm2_tokenizer):
    # Rows: no grammar, a live grammar, a terminated one, another live one at a later state.
    choice = StructuredOutputsParams(choice=["alpha", "beta"])
    live, terminated, advanced = (_grammar(manager, choice) for _ in range(3))
    alpha = smollm2_tokenizer("alpha", add_special_tokens=False)["input_ids"]
    assert terminated.accept_tokens([*alpha, smollm2_tokenizer.eos_token_id]) and terminated.is_terminated()
    assert advanced.accept_tokens(alpha[:1])
    grammars = [None, live, terminated, advanced]
    fresh = _bitmask(manager, grammars)
    assert (fresh[0] == -1).all() and (fresh[2] == -1).all()
    assert not (fresh[1] == -1).all() and not torch.equal(fresh[1], fresh[3])
    # A buffer with stale contents and spare rows: the first rows equal the fresh mask.
    dirty = torch.zeros((6, fresh.shape[1]), dtype=torch.int32)
    assert torch.equal(_bitmask(manager, grammars, out=dirty), fresh)
    assert torch.equal(dirty[:4], fresh)


@pytest.mark.parametrize("seed", range(3))
def test_batch_advance_equals_accepting_token_by_token(manager, smollm2_tokenizer, seed):
    """``GrammarBatch.advance`` (llguidance's executor from 8 text tokens, a loop below) leaves
    each grammar where ``accept_tokens`` does: same verdicts, counts, termination and next mask,
    on random allowed tokens, stop tokens where the grammar is complete, and refused tokens."""
    generator = torch.Generator().manual_seed(seed)
    eos = smollm2_tokenizer.eos_token_id
    refused = smollm2_tokenizer("zzz", add_special_tokens=False)["input_ids"][0]
    constraints = [StructuredOutputsParams(json=SCHEMA), StructuredOutputsParams(choice=["alpha", "beta"])]
    for num_rows in (3, 12):  # below and above the executor's threshold
        params = [constraints[i % 2] for i in range(num_rows)]
        batched = [_grammar(manager, p) for p in params]
        single = [_grammar(manager, p) for p in params]
        batch = GrammarBatch()
        for step in range(60):
            masks = _bitmask(manager, batched)
            assert torch.equal(masks, _bitmask(manager, single)), step
            logits = torch.randn((num_rows, manager.vocab_size), generator=generator)
            apply_token_bitmask(logits, masks)
            tokens = logits.argmax(dim=1).tolist()
            if step % 7 == 3:
                tokens[step % num_rows] = refused
            verdicts = batch.advance(batched, tokens)
            assert verdicts == [g.accept_tokens([t]) for g, t in zip(single, tokens)]
            assert [g.num_processed_tokens for g in batched] == [g.num_processed_tokens for g in single]
            assert [g.is_terminated() for g in batched] == [g.is_terminated() for g in single]
            if any(t == eos for t in tokens):
                assert any(g.is_terminated() for g in batched)
            # Grammars that ended or refused a token start over, in both lists alike.
            for i, verdict in enumerate(verdicts):
                if not verdict or batched[i].is_terminated():
                    batched[i], single[i] = _grammar(manager, params[i]), _grammar(manager, params[i])


@pytest.mark.parametrize("vocab_size", [1, 31, 32, 33, 100, 49152])
def test_apply_token_bitmask_equals_llguidances_and_the_definition(vocab_size):
    generator = torch.Generator().manual_seed(vocab_size)
    num_rows = 3
    bitmask = allocate_token_bitmask(num_rows, vocab_size)
    bitmask.copy_(
        torch.randint(-(2**31), 2**31, bitmask.shape, generator=generator, dtype=torch.int64).to(torch.int32)
    )
    logits = torch.randn((num_rows, vocab_size), generator=generator)
    ours, theirs = logits.clone(), logits.clone()
    apply_token_bitmask(ours, bitmask)
    # llguidance's numpy kernel: its torch one goes through torch.compile.
    llguidance.numpy.apply_token_bitmask_inplace(theirs.numpy(), bitmask.numpy())
    torch.testing.assert_close(ours, theirs)
    for row in range(num_rows):
        for token in range(0, vocab_size, max(1, vocab_size // 64)):
            allowed = (int(bitmask[row, token // 32]) >> (token % 32)) & 1
            assert ours[row, token].item() == (logits[row, token].item() if allowed else float("-inf"))


def test_apply_token_bitmask_refuses_a_wrong_shape():
    with pytest.raises(ValueError, match="bitmask must be int32"):
        apply_token_bitmask(torch.zeros((2, 64)), allocate_token_bitmask(1, 64))
