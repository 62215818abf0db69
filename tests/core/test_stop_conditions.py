"""The core's stop conditions: EOS, stop token ids, min_tokens, max_tokens and the context limit."""

from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.stop_conditions import ends_with_samples_in_flight, stop_reason, stop_status
from pagedllm.sampling_params import SamplingParams

EOS = 0
STOPPED, CAPPED = RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED


def make_request(prompt_len: int, outputs: list[int], **params) -> Request:
    request = Request(0, list(range(1, prompt_len + 1)), SamplingParams(**params), 16, eos_token_ids=[EOS])
    for token_id in outputs:
        request.append_output_token(token_id, 0.0)
    return request


def newest(request: Request, max_context_len: int | None = 8) -> RequestStatus | None:
    """The status the request's newest token ends it with."""
    token_id = request.output_token_ids[-1]
    return stop_status(request, token_id, request.num_output_tokens, max_context_len)


def test_eos_stops_unless_ignored_or_before_min_tokens():
    assert newest(make_request(2, [EOS], min_tokens=2)) is None, "EOS before min_tokens does not stop"
    assert newest(make_request(2, [EOS], ignore_eos=True)) is None
    assert newest(make_request(2, [EOS])) == STOPPED
    assert newest(make_request(2, [5, EOS], min_tokens=2)) == STOPPED
    assert stop_reason(make_request(2, [EOS]), EOS) is None


def test_a_stop_token_id_stops_and_is_the_stop_reason():
    request = make_request(2, [42], stop_token_ids=[42])
    assert newest(request) == STOPPED and stop_reason(request, 42) == 42
    assert newest(make_request(2, [42], stop_token_ids=[42], min_tokens=3)) is None
    # EOS listed among the stop ids is still EOS: no stop reason.
    request = make_request(2, [EOS], stop_token_ids=[EOS])
    assert newest(request) == STOPPED and stop_reason(request, EOS) is None


def test_lengths_cap_and_a_stop_token_on_the_last_allowed_token_wins():
    assert newest(make_request(2, [7, 7, 7], max_tokens=3)) == CAPPED
    assert newest(make_request(2, [7, 7], max_tokens=3)) is None
    # Prompt 7 + 1 output = 8 tokens = the context limit; None: no limit (attention sinks).
    assert newest(make_request(7, [7], max_tokens=100)) == CAPPED
    assert newest(make_request(7, [7], max_tokens=100), None) is None
    assert newest(make_request(2, [7, 7, EOS], max_tokens=3)) == STOPPED


def test_a_token_is_weighed_before_it_is_appended():
    request = make_request(2, [7], max_tokens=3)
    assert stop_status(request, EOS, 2, 8) == STOPPED
    assert stop_status(request, 7, 2, 8) is None
    assert stop_status(request, 7, 3, 8) == CAPPED
    assert request.output_token_ids == [7] and request.stop_reason is None


def test_samples_in_flight_that_reach_the_length_limit_end_the_request():
    request = make_request(2, [7], max_tokens=3)
    request.num_output_placeholders = 1
    assert not ends_with_samples_in_flight(request, 8)
    request.num_output_placeholders = 2
    assert ends_with_samples_in_flight(request, 8)
    request = make_request(6, [7], max_tokens=100)
    request.num_computed_tokens = 7
    assert not ends_with_samples_in_flight(request, 8)
    request.num_computed_tokens = 8
    assert ends_with_samples_in_flight(request, 8) and not ends_with_samples_in_flight(request, None)
