import pytest

from pagedllm.sampling_params import SamplingParams, SamplingType


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"n": 0}, "n"),
        ({"n": 2, "best_of": 1, "temperature": 1.0}, "best_of"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3.0}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"logprobs": 21}, "logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"n": 2, "temperature": 0.0}, "best_of"),
        ({"use_beam_search": True, "best_of": 1}, "best_of"),
        ({"use_beam_search": True, "best_of": 2, "temperature": 0.5}, "temperature"),
        ({"use_beam_search": True, "best_of": 2, "temperature": 0.0, "top_k": 5}, "top_k"),
        ({"length_penalty": 0.5}, "length_penalty"),
        ({"early_stopping": True}, "early_stopping"),
    ],
)
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field} must be"):
        SamplingParams(**kwargs)


def test_defaults_and_normalisation():
    params = SamplingParams(n=3, stop="###", top_k=0)
    assert params.best_of == 3
    assert params.stop == ["###"]
    assert params.top_k == -1
    assert params.sampling_type == SamplingType.RANDOM
    assert SamplingParams(temperature=0.0).sampling_type == SamplingType.GREEDY
    assert SamplingParams(seed=1).sampling_type == SamplingType.RANDOM_SEED
    assert SamplingParams(use_beam_search=True, best_of=2, temperature=0.0).sampling_type == SamplingType.BEAM
    # Greedy ignores the truncation options.
    greedy = SamplingParams(temperature=0.0, top_p=0.5, top_k=3, min_p=0.2)
    assert (greedy.top_p, greedy.top_k, greedy.min_p) == (1.0, -1, 0.0)
    assert SamplingParams(stop=["a", "abcd"]).max_stop_string_len == 4
