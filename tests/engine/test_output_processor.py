"""The frontend's output processor: the core's token ids become text and RequestOutputs.

Driven with hand-made ``EngineCoreOutputs`` (what the core sends) and the real SmolLM2 tokenizer;
the expected text is the tokenizer's own decode of the whole output, cut where the stop string
starts. DELTA outputs joined equal the CUMULATIVE outputs' last state, FINAL_ONLY sends one
output, forks join by index, a stop string ends the sequence here and is handed back to the core.
"""

from __future__ import annotations

import pytest

from pagedllm.engine.output_processor import OutputProcessor, RequestState
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams
from pagedllm.step_io import EngineCoreOutput, EngineCoreOutputs

PROMPT = [1, 2, 3]


def _state(request_id: str, params: SamplingParams, kind: RequestOutputKind) -> RequestState:
    return RequestState(request_id, None, PROMPT, params, kind, arrival_time=0.0)


def _step(
    request_id: str, token_id: int, index: int = 0, finish: str | None = None, **kw
) -> EngineCoreOutputs:
    logprobs = [(-0.5, 1, [token_id], [-0.5])] if kw.get("logprobs") else None
    out = EngineCoreOutput(request_id, index, [token_id], logprobs, -0.5, finish)
    finished = {request_id: None} if kw.get("ends") else {}
    return EngineCoreOutputs(outputs=[out], finished_requests=finished)


def _run(processor: OutputProcessor, steps: list[EngineCoreOutputs]) -> tuple[list[RequestOutput], list]:
    outputs, stopped = [], []
    for step in steps:
        step_outputs, step_stopped = processor.process_outputs(step)
        outputs += step_outputs
        stopped += step_stopped
    return outputs, stopped


@pytest.mark.parametrize("kind", list(RequestOutputKind))
def test_a_stop_string_ends_the_sequence_in_every_output_kind(smollm2_tokenizer, kind):
    tokenizer = smollm2_tokenizer
    token_ids = tokenizer("The answer is forty-two. END of story", add_special_tokens=False)["input_ids"]
    params = SamplingParams(stop=["END"], logprobs=1, max_tokens=100)
    processor = OutputProcessor(tokenizer)
    processor.add_request(_state("r", params, kind))
    outputs, stopped = _run(processor, [_step("r", t, logprobs=True) for t in token_ids])

    whole = tokenizer.decode(token_ids)
    expected_text = whole[: whole.index("END")]
    assert stopped == [("r", 0)], "the sequence is handed back to the core once"
    final = outputs[-1]
    assert final.finished and not processor.requests
    if kind == RequestOutputKind.FINAL_ONLY:
        assert len(outputs) == 1
    if kind == RequestOutputKind.DELTA:
        seqs = [o.outputs[0] for o in outputs if o.outputs]
        text = "".join(s.text for s in seqs)
        ids = [t for s in seqs for t in s.token_ids]
        logprobs = [lp for s in seqs for lp in s.logprobs]
    else:
        text, ids, logprobs = final.outputs[0].text, final.outputs[0].token_ids, final.outputs[0].logprobs
    num_emitted = len(ids)
    assert text == expected_text
    assert ids == token_ids[:num_emitted] and num_emitted < len(token_ids)
    assert [next(iter(entry)) for entry in logprobs] == ids
    assert final.outputs[-1].finish_reason == "stop" and final.outputs[-1].stop_reason == "END"


def test_delta_outputs_never_take_text_back_and_hold_a_stop_string_prefix(smollm2_tokenizer):
    tokenizer = smollm2_tokenizer
    token_ids = tokenizer("abc STO and more STOP", add_special_tokens=False)["input_ids"]
    processor = OutputProcessor(tokenizer)
    processor.add_request(_state("r", SamplingParams(stop=["STOP"], max_tokens=100), RequestOutputKind.DELTA))
    outputs, _ = _run(processor, [_step("r", t) for t in token_ids])
    pieces = [o.outputs[0].text for o in outputs if o.outputs]
    sent = ""
    for piece in pieces:
        sent += piece
        assert "STOP" not in sent
    whole = tokenizer.decode(token_ids)
    assert sent == whole[: whole.index("STOP")]


def test_forks_join_by_index_and_the_request_ends_with_its_last_sequence(smollm2_tokenizer):
    params = SamplingParams(n=2, temperature=1.0, max_tokens=3)
    processor = OutputProcessor(smollm2_tokenizer)
    processor.add_request(_state("r", params, RequestOutputKind.CUMULATIVE))
    first = EngineCoreOutputs(
        outputs=[EngineCoreOutput("r", 0, [100], None, -1.0), EngineCoreOutput("r", 1, [200], None, -2.0)]
    )
    outputs, _ = _run(processor, [first, _step("r", 101), _step("r", 102, finish="length")])
    assert [len(o.outputs) for o in outputs] == [2, 2, 2]
    assert not outputs[-1].finished, "sequence 1 still runs"
    outputs, _ = _run(processor, [_step("r", 201, index=1, finish="stop", ends=True)])
    final = outputs[-1]
    assert final.finished
    assert [c.token_ids for c in final.outputs] == [[100, 101, 102], [200, 201]]
    assert [c.finish_reason for c in final.outputs] == ["length", "stop"]


def test_abort_ends_running_sequences_and_forgets_the_request(smollm2_tokenizer):
    processor = OutputProcessor(smollm2_tokenizer)
    processor.add_request(_state("r", SamplingParams(max_tokens=10), RequestOutputKind.FINAL_ONLY))
    outputs, _ = _run(processor, [_step("r", 100), _step("r", 101)])
    assert outputs == []
    [final] = processor.abort(["r"])
    assert final.finished and final.outputs[0].finish_reason == "abort"
    assert final.outputs[0].token_ids == [100, 101]
    assert (
        final.outputs[0].text
        == smollm2_tokenizer.decode([1, 2, 3, 100, 101])[len(smollm2_tokenizer.decode([1, 2, 3])) :]
    )
    assert processor.abort(["r"]) == [] and not processor.requests


def test_a_stop_string_inside_a_verified_run_ends_the_sequence_and_the_request_there(smollm2_tokenizer):
    """Speculative decoding reports several tokens of a sequence in one step (a verified run of
    drafts, one output per token): tokens after the one completing a stop string are dropped, and
    the sequence and its request end there."""
    tokenizer = smollm2_tokenizer
    token_ids = tokenizer("The answer is forty-two. END of story", add_special_tokens=False)["input_ids"]
    params = SamplingParams(stop=["END"], max_tokens=100)
    processor = OutputProcessor(tokenizer)
    processor.add_request(_state("r", params, RequestOutputKind.FINAL_ONLY))
    one_step = EngineCoreOutputs(outputs=[EngineCoreOutput("r", 0, [t], None, -0.5, None) for t in token_ids])
    outputs, stopped = _run(processor, [one_step])
    whole = tokenizer.decode(token_ids)
    assert stopped == [("r", 0)]
    assert len(outputs) == 1 and outputs[0].finished and not processor.requests
    assert outputs[0].outputs[0].text == whole[: whole.index("END")]
    assert outputs[0].outputs[0].finish_reason == "stop"
