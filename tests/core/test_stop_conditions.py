"""The core's stop conditions: EOS, stop token ids, min_tokens, max_tokens and the context limit."""

from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.stop_conditions import check_stop, ends_with_samples_in_flight, stop_status
from pagedllm.sampling_params import SamplingParams

EOS = 0


def make_request(prompt_len: int, outputs: list[int], **params) -> Request:
    request = Request(0, list(range(1, prompt_len + 1)), SamplingParams(**params), 16, eos_token_ids=[EOS])
    for token_id in outputs:
        request.append_output_token(token_id, 0.0)
    return request


def test_eos_stops_unless_ignored_or_before_min_tokens():
    assert check_stop(make_request(2, [EOS], min_tokens=2), 8) is None, "EOS before min_tokens does not stop"
    assert check_stop(make_request(2, [EOS], ignore_eos=True), 8) is None
    request = make_request(2, [EOS])
    assert check_stop(request, 8) == RequestStatus.FINISHED_STOPPED
    assert request.stop_reason is None
    assert check_stop(make_request(2, [5, EOS], min_tokens=2), 8) == RequestStatus.FINISHED_STOPPED


def test_a_stop_token_id_stops_and_is_the_stop_reason():
    request = make_request(2, [42], stop_token_ids=[42])
    assert check_stop(request, 8) == RequestStatus.FINISHED_STOPPED
    assert request.stop_reason == 42
    assert check_stop(make_request(2, [42], stop_token_ids=[42], min_tokens=3), 8) is None
    # EOS listed among the stop ids is still EOS: no stop reason.
    request = make_request(2, [EOS], stop_token_ids=[EOS])
    assert check_stop(request, 8) == RequestStatus.FINISHED_STOPPED and request.stop_reason is None


def test_lengths_cap_and_a_stop_token_on_the_last_allowed_token_wins():
    assert check_stop(make_request(2, [7, 7, 7], max_tokens=3), 8) == RequestStatus.FINISHED_LENGTH_CAPPED
    assert check_stop(make_request(2, [7, 7], max_tokens=3), 8) is None
    # Prompt 7 + 1 output = 8 tokens = the context limit; None: no limit (attention sinks).
    assert check_stop(make_request(7, [7], max_tokens=100), 8) == RequestStatus.FINISHED_LENGTH_CAPPED
    assert check_stop(make_request(7, [7], max_tokens=100), None) is None
    assert check_stop(make_request(2, [7, 7, EOS], max_tokens=3), 8) == RequestStatus.FINISHED_STOPPED


def test_stop_status_weighs_a_token_before_it_is_appended():
    request = make_request(2, [7], max_tokens=3)
    assert stop_status(request, EOS, 2, 8) == RequestStatus.FINISHED_STOPPED
    assert stop_status(request, 7, 2, 8) is None
    assert stop_status(request, 7, 3, 8) == RequestStatus.FINISHED_LENGTH_CAPPED
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
