"""How the engine core reports tokens: each as it is sampled for a request whose frontend needs
them (it streams, matches stop strings, returns logprobs or fans out), else its first token and
then the rest at its end. A request's final output is the same either way, its time to first
token is still recorded, and an abort or a failure returns every token it had."""

from __future__ import annotations

import itertools

import pytest
from transformers import LlamaConfig

from pagedllm import LLM, SamplingParams
from pagedllm.engine.output_processor import RequestState
from pagedllm.sampling_params import RequestOutputKind


@pytest.fixture(scope="module")
def engine(make_tiny_model_for_module):
    _, model_config = make_tiny_model_for_module(LlamaConfig)
    llm = LLM(model_config.model, device="cpu", max_model_len=256)
    yield llm.llm_engine
    llm.llm_engine.shutdown()


def _prompt(i: int) -> list[int]:
    return [3 + (7 * i + j) % 90 for j in range(5 + i % 4)]


def _finals(engine, stream: bool, params: list[SamplingParams]) -> dict[str, tuple]:
    for i, p in enumerate(params):
        engine.add_request(f"{stream}-{i}", sampling_params=p, prompt_token_ids=_prompt(i), stream=stream)
    finals = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                seq = output.outputs[0]
                key = output.request_id.split("-", 1)[1]
                finals[key] = (list(seq.token_ids), seq.finish_reason, seq.cumulative_logprob)
                assert output.metrics.first_token_time is not None
    return finals


def test_a_request_reported_at_its_end_gives_the_streamed_requests_output(engine):
    params = [
        SamplingParams(temperature=0.0, max_tokens=1 + i * 3, ignore_eos=True, stop_token_ids=[40 + i])
        for i in range(8)
    ]
    streamed, at_end = _finals(engine, True, params), _finals(engine, False, params)
    assert at_end == streamed
    assert {finish for _, finish, _ in at_end.values()} <= {"length", "stop"}


def test_the_core_reports_the_first_token_then_the_rest_at_the_end(engine):
    """Outputs per request out of EngineCore.step: every step for the streamed one, two for the
    other (its first token; all the others, with its end)."""
    core = engine.engine_core
    params = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
    engine.add_request("each", sampling_params=params, prompt_token_ids=_prompt(1), stream=True)
    engine.add_request("end", sampling_params=params, prompt_token_ids=_prompt(1), stream=False)
    reported: dict[str, list[list[int]]] = {"each": [], "end": []}
    while core.has_unfinished_requests():
        out = core.step()
        for output in out.outputs:
            reported[output.request_id].append(output.new_token_ids)
        engine.output_processor.process_outputs(out)
    assert len(reported["each"]) == 9 and all(len(tokens) == 1 for tokens in reported["each"])
    assert [len(tokens) for tokens in reported["end"]] == [1, 8]
    assert list(itertools.chain(*reported["end"])) == list(itertools.chain(*reported["each"]))


def test_an_abort_returns_every_token_the_request_had(engine):
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    for stream in (True, False):
        engine.add_request(
            f"abort-{stream}", sampling_params=params, prompt_token_ids=_prompt(2), stream=stream
        )
    for _ in range(6):
        engine.step()
    aborted = {o.request_id: o.outputs[0] for o in engine.abort_request(["abort-True", "abort-False"])}
    streamed, at_end = aborted["abort-True"], aborted["abort-False"]
    assert len(at_end.token_ids) > 1 and at_end.token_ids == streamed.token_ids
    assert at_end.finish_reason == streamed.finish_reason == "abort"
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize(
    ("kind", "params", "each"),
    [
        (RequestOutputKind.FINAL_ONLY, SamplingParams(), False),
        (RequestOutputKind.CUMULATIVE, SamplingParams(), True),
        (RequestOutputKind.DELTA, SamplingParams(), True),
        (RequestOutputKind.FINAL_ONLY, SamplingParams(stop=["x"]), True),
        (RequestOutputKind.FINAL_ONLY, SamplingParams(logprobs=0), True),
        (RequestOutputKind.FINAL_ONLY, SamplingParams(n=2, temperature=1.0), True),
        (RequestOutputKind.FINAL_ONLY, SamplingParams(best_of=2, temperature=1.0), True),
    ],
)
def test_which_requests_need_each_token(kind, params, each):
    assert RequestState("r", None, [1, 2], params, kind, arrival_time=0.0).needs_each_token is each
