"""Structured outputs on the embedded model's tokenizer: decoding from random logits through the
bitmask always yields text in the grammar, for every kind of constraint, with the grammar
extension's matchers and with llguidance's ``LLMatcher`` (where the extension is unavailable);
the extension's ahead thread advances grammars exactly as ``accept_tokens`` does."""

from __future__ import annotations

import json
import re
import threading
import time

import jsonschema
import llguidance.hf
import llguidance.numpy
import numpy as np
import pytest
import torch

from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured_output import (
    GrammarAheadWorker,
    GrammarBatch,
    StructuredOutputGrammar,
    StructuredOutputManager,
    allocate_token_bitmask,
    apply_token_bitmask,
    native,
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


def _new_manager(tokenizer, use_native: bool) -> StructuredOutputManager:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(native, "available", lambda: use_native)
        manager = StructuredOutputManager(tokenizer, 49152, [tokenizer.eos_token_id])
        manager._grammar_tokenizer()  # which kind of matcher it compiles is decided here
    return manager


@pytest.fixture(scope="module", params=["native", "llmatcher"])
def manager(request, smollm2_tokenizer) -> StructuredOutputManager:
    if request.param == "native" and not native.available():
        pytest.skip("the grammar extension does not build here")
    manager = _new_manager(smollm2_tokenizer, request.param == "native")
    yield manager
    manager.shutdown()


@pytest.fixture(scope="module")
def managers(smollm2_tokenizer) -> tuple[StructuredOutputManager, StructuredOutputManager]:
    """(the extension's, LLMatcher's)."""
    if not native.available():
        pytest.skip("the grammar extension does not build here")
    pair = (_new_manager(smollm2_tokenizer, True), _new_manager(smollm2_tokenizer, False))
    yield pair
    for manager in pair:
        manager.shutdown()


@pytest.mark.parametrize("use_native", [True, False])
def test_grammar_tokenizer_is_built_by_the_first_compilation_once(
    smollm2_tokenizer, monkeypatch: pytest.MonkeyPatch, use_native: bool
) -> None:
    """An engine serving no constrained request never builds llguidance's tokenizer (30-70 MB of
    resident memory for SmolLM2); concurrent first compilations build it once."""
    if use_native and not native.available():
        pytest.skip("the grammar extension does not build here")
    built = []
    module, name = (native, "new_tokenizer") if use_native else (llguidance.hf, "from_tokenizer")
    build = getattr(module, name)

    def counted(*args, **kwargs):
        built.append(args)
        return build(*args, **kwargs)

    monkeypatch.setattr(native, "available", lambda: use_native)
    monkeypatch.setattr(module, name, counted)
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


def test_grammar_api_advances_stops_and_rolls_back_over_its_stop_token(manager, smollm2_tokenizer):
    """What callers use of a grammar: its stop tokens; ``accept_tokens`` counting processed tokens,
    refusing a stop token before the output is complete and anything after it; ``rollback``
    undoing the stop token (no longer terminated) and then text tokens."""
    eos = smollm2_tokenizer.eos_token_id
    grammar = _grammar(manager, StructuredOutputsParams(choice=["alpha", "beta"]))
    assert grammar.stop_token_ids == frozenset([eos])
    alpha = smollm2_tokenizer("alpha", add_special_tokens=False)["input_ids"]
    start = _bitmask(manager, [grammar])
    assert grammar.accept_tokens(alpha[:1]) and grammar.num_processed_tokens == 1
    if len(alpha) > 1:  # a stop token before the output is complete
        early = _grammar(manager, StructuredOutputsParams(choice=["alpha"]))
        assert not early.accept_tokens([*alpha[:1], eos]) and not early.is_terminated()
    assert grammar.accept_tokens([*alpha[1:], eos]) and grammar.is_terminated()
    assert grammar.num_processed_tokens == len(alpha) + 1
    assert not grammar.accept_tokens(alpha[:1])  # nothing after the end
    grammar.rollback(1)
    assert not grammar.is_terminated() and grammar.num_processed_tokens == len(alpha)
    grammar.rollback(len(alpha))
    assert grammar.num_processed_tokens == 0 and torch.equal(_bitmask(manager, [grammar]), start)


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


def _allowed(mask: torch.Tensor, vocab_size: int) -> np.ndarray:
    bits = np.unpackbits(mask.contiguous().numpy().view(np.uint8), axis=-1, bitorder="little")
    return bits[..., :vocab_size].astype(bool)


@pytest.mark.parametrize("seed", range(3))
def test_extension_masks_allow_llmatchers_and_only_what_it_accepts(managers, smollm2_tokenizer, seed):
    """The extension's masks contain LLMatcher's (which allows only the canonical split of the
    bytes a grammar forces) and allow nothing LLMatcher refuses, along random walks through
    every kind of constraint; both agree on random tokens' verdicts and on termination."""
    ours, theirs = managers
    generator = torch.Generator().manual_seed(seed)
    eos = smollm2_tokenizer.eos_token_id
    for params in (
        StructuredOutputsParams(json=SCHEMA),
        StructuredOutputsParams(json_object=True),
        StructuredOutputsParams(regex=r"[a-c]{2,5}-[0-9]{3}"),
        StructuredOutputsParams(choice=['say "yes"', "no"]),
        StructuredOutputsParams(grammar='root ::= "(" [1-9]+ ")"'),
    ):
        native_grammar, python_grammar = _grammar(ours, params), _grammar(theirs, params)
        assert native_grammar.is_native and not python_grammar.is_native
        history: list[int] = []
        for _ in range(40):
            native_mask = _allowed(_bitmask(ours, [native_grammar]), ours.vocab_size)[0]
            python_mask = _allowed(_bitmask(theirs, [python_grammar]), theirs.vocab_size)[0]
            assert not (python_mask & ~native_mask).any()
            extra = np.flatnonzero(native_mask & ~python_mask)
            for token in extra[torch.randperm(len(extra), generator=generator)[:3].numpy()].tolist():
                assert _grammar(theirs, params).accept_tokens([*history, token])
            probe = int(torch.randint(ours.vocab_size, (1,), generator=generator))
            native_probe, python_probe = _grammar(ours, params), _grammar(theirs, params)
            verdict = native_probe.accept_tokens([*history, probe])
            assert verdict == python_probe.accept_tokens([*history, probe]) == bool(native_mask[probe])
            logits = torch.randn(ours.vocab_size, generator=generator)
            logits[~torch.from_numpy(python_mask)] = float("-inf")
            token = int(logits.argmax())
            assert native_grammar.accept_tokens([token]) and python_grammar.accept_tokens([token])
            assert native_grammar.is_terminated() == python_grammar.is_terminated()
            if native_grammar.is_terminated():
                assert token == eos
                break
            history.append(token)


@pytest.mark.parametrize("seed", range(3))
def test_ahead_worker_advances_grammars_as_accept_tokens_does(managers, smollm2_tokenizer, seed):
    """The extension's ahead thread, given a step's samples, leaves each grammar where
    ``accept_tokens`` does: same verdicts (text and stop tokens where the grammar is complete,
    refused tokens), same processed tokens and termination, and the next mask at its mask row
    equal to the one filled afresh."""
    manager = managers[0]
    generator = torch.Generator().manual_seed(seed)
    eos = smollm2_tokenizer.eos_token_id
    refused = smollm2_tokenizer("zzz", add_special_tokens=False)["input_ids"][0]
    worker = GrammarAheadWorker(manager.vocab_size, timeout_s=10.0)
    constraints = [StructuredOutputsParams(json=SCHEMA), StructuredOutputsParams(choice=["alpha", "beta"])]
    num_rows = 12
    params = [constraints[i % 2] for i in range(num_rows)]
    ahead = [_grammar(manager, p) for p in params]
    single = [_grammar(manager, p) for p in params]
    out = allocate_token_bitmask(num_rows + 2, manager.vocab_size)
    restarted = True
    for step in range(60):
        masks = _bitmask(manager, ahead)
        assert torch.equal(masks, _bitmask(manager, single)), step
        logits = torch.randn((num_rows, manager.vocab_size), generator=generator)
        apply_token_bitmask(logits, masks)
        tokens = logits.argmax(dim=1)
        if step % 7 == 3:
            tokens[step % num_rows] = refused
        # The samples land after the job is submitted, as a device copy would write them.
        samples = torch.full((num_rows + 1,), -1, dtype=torch.int64)
        sample_rows = list(range(1, num_rows + 1))
        mask_rows = [row + 1 for row in sample_rows]
        if step % 2 and not restarted:  # the same grammars and rows as the last job
            worker.resubmit(samples, out)
        else:
            worker.submit(samples, ahead, sample_rows, out, mask_rows=mask_rows)
        time.sleep(0.001)
        samples[1:] = tokens
        result = worker.wait()
        assert result is not None and result.token_ids == tokens.tolist()
        verdicts = [g.accept_tokens([t]) for g, t in zip(single, tokens.tolist())]
        assert result.accepted == verdicts
        assert result.all_consumed == (result.rows == mask_rows)
        for i, row in enumerate(result.rows):
            if row >= 0:  # took its sample as text: its next mask is at its mask row
                assert row == mask_rows[i] and not ahead[i].is_terminated()
                assert torch.equal(out[row], _bitmask(manager, [single[i]])[0]), (step, i)
        assert [g.num_processed_tokens for g in ahead] == [g.num_processed_tokens for g in single]
        assert [g.is_terminated() for g in ahead] == [g.is_terminated() for g in single]
        if (tokens == eos).any():
            assert any(g.is_terminated() for g in ahead)
        # Grammars that ended or refused a token start over, in both lists alike.
        restarted = False
        for i, verdict in enumerate(verdicts):
            if not verdict or ahead[i].is_terminated():
                ahead[i], single[i] = _grammar(manager, params[i]), _grammar(manager, params[i])
                restarted = True


def test_ahead_worker_whose_samples_never_land_leaves_its_grammars_as_they_were(managers):
    manager = managers[0]
    grammar = _grammar(manager, StructuredOutputsParams(choice=["alpha", "beta"]))
    out = allocate_token_bitmask(2, manager.vocab_size)
    before = out.clone()
    worker = GrammarAheadWorker(manager.vocab_size, timeout_s=0.05)
    worker.submit(torch.full((2,), -1, dtype=torch.int64), [grammar], [0], out)
    assert worker.wait() is None
    assert torch.equal(out, before) and grammar.num_processed_tokens == 0 and not grammar.is_terminated()


def test_the_extension_refuses_a_slow_tokenizer():
    class SlowTokenizer:
        is_fast = False

    with pytest.raises(ValueError, match="fast"):
        native.new_tokenizer(SlowTokenizer(), 100, [0])


def test_ahead_worker_checks_its_job_and_gives_up_on_samples_that_never_land(managers, smollm2_tokenizer):
    manager = managers[0]
    extension = native.load()
    matcher = manager.compile(StructuredOutputsParams(choice=["alpha", "beta"])).result(timeout=60).matcher
    out = allocate_token_bitmask(2, manager.vocab_size)
    samples = torch.full((2,), -1, dtype=torch.int64)
    worker = extension.AheadWorker([smollm2_tokenizer.eos_token_id], manager.vocab_size, 0.05)
    args = (samples.data_ptr(), 2, [matcher.deep_copy()])
    with pytest.raises(IndexError, match="sample row"):
        worker.submit(*args, [2], [0], out.data_ptr(), out.shape[1] * 4, 2)
    with pytest.raises(IndexError, match="mask row"):
        worker.submit(*args, [0], [2], out.data_ptr(), out.shape[1] * 4, 2)
    with pytest.raises(ValueError, match="mask rows of 4 bytes"):  # llguidance would write past them
        worker.submit(*args, [0], [0], out.data_ptr(), 4, 2)
    assert worker.wait() == ([], [])  # nothing was submitted
    with pytest.raises(RuntimeError, match="no job"):
        worker.resubmit(samples.data_ptr(), 2, out.data_ptr(), 2)
    before = out.clone()
    worker.submit(*args, [0], [0], out.data_ptr(), out.shape[1] * 4, 2)
    with pytest.raises(RuntimeError, match="not collected"):
        worker.submit(*args, [0], [0], out.data_ptr(), out.shape[1] * 4, 2)
    # A value past the vocabulary (a half-written sample) is not taken for a token either.
    samples[0] = manager.vocab_size
    assert worker.wait() == ([extension.TIMED_OUT], [-1])
    assert torch.equal(out, before)
    with pytest.raises(IndexError, match="mask row"):  # the last job's rows, checked again
        worker.resubmit(samples.data_ptr(), 2, out.data_ptr(), 0)
    # Cancelled: a failed step's job ends at once.
    samples[0] = -1
    worker = extension.AheadWorker([smollm2_tokenizer.eos_token_id], manager.vocab_size, 60.0)
    worker.submit(*args, [0], [0], out.data_ptr(), out.shape[1] * 4, 2)
    threading.Timer(0.05, worker.cancel).start()
    start = time.perf_counter()
    assert worker.wait()[0] == [extension.TIMED_OUT]
    assert time.perf_counter() - start < 5


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


def test_prepare_builds_the_extension_aside_and_says_when_it_is_ready(smollm2_tokenizer, monkeypatch):
    build_done = threading.Event()
    monkeypatch.setattr(native, "is_built", lambda: False)
    monkeypatch.setattr(native, "available", lambda: build_done.wait(30))
    manager = StructuredOutputManager(smollm2_tokenizer, 49152, [smollm2_tokenizer.eos_token_id])
    try:
        assert manager.is_ready  # offline: the first compile builds it, with no limit to beat
        manager.prepare()
        assert not manager.is_ready
        build_done.set()
        deadline = time.monotonic() + 10
        while not manager.is_ready and time.monotonic() < deadline:
            time.sleep(0.01)
        assert manager.is_ready
    finally:
        manager.shutdown()


def test_prepare_loads_a_built_extension_at_once(smollm2_tokenizer, monkeypatch):
    loaded = []
    monkeypatch.setattr(native, "is_built", lambda: True)
    monkeypatch.setattr(native, "available", lambda: loaded.append(True) or True)
    manager = StructuredOutputManager(smollm2_tokenizer, 49152, [smollm2_tokenizer.eos_token_id])
    manager.prepare()
    assert loaded == [True] and manager.is_ready
    manager.shutdown()
