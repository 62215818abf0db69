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


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"presence_penalty": float("nan")}, "presence_penalty"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"top_p": float("nan")}, "top_p"),
        ({"temperature": "hot"}, "temperature"),
        ({"n": "2"}, "n"),
        ({"n": 1.5}, "n"),
        ({"max_tokens": True}, "max_tokens"),
        ({"seed": 2**64}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"seed": "7"}, "seed"),
        ({"stop": 5}, "stop"),
        ({"stop": ["x"] * 65}, "stop"),
        ({"stop": ["x" * 1025]}, "stop"),
        ({"stop_token_ids": "12"}, "stop_token_ids"),
        ({"stop_token_ids": [1.5]}, "stop_token_ids"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [-3]}, "allowed_token_ids"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"five": 1}}, "logit_bias"),
        # Digits to str.isdigit() and int(), but no token ids: superscripts, Arabic-Indic digits.
        ({"logit_bias": {"\u00b2": 1}}, "logit_bias"),
        ({"logit_bias": {"\u0661\u0662": 1}}, "logit_bias"),
        ({"logit_bias": {5: float("inf")}}, "logit_bias"),
        ({"logit_bias": [1, 2]}, "logit_bias"),
        ({"bad_words": [""]}, "bad_words"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"structured_outputs": "json"}, "structured_outputs"),
    ],
)
def test_wrong_types_and_non_finite_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field} must be"):
        SamplingParams(**kwargs)


def test_seed_boundaries_are_what_torch_generators_take():
    import torch

    for seed in (-(2**63), 0, 2**63, 2**64 - 1):
        torch.Generator().manual_seed(SamplingParams(seed=seed).seed)


def test_numpy_and_torch_numbers_become_python_ones():
    import numpy as np
    import torch

    params = SamplingParams(
        n=np.int64(2),
        seed=torch.tensor(3),
        temperature=np.float32(0.5),
        stop_token_ids=np.array([1, 2]),
        logit_bias={np.int32(4): np.float64(1.5), "6": -2},
    )
    assert (params.n, params.seed, params.stop_token_ids) == (2, 3, [1, 2])
    assert type(params.n) is int and type(params.seed) is int and type(params.temperature) is float
    assert params.logit_bias == {4: 1.5, 6: -2.0}


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"json": {"type": "object"}, "regex": "a+"},
        {"json": "{not json"},
        {"json": [1, 2]},
        {"regex": ""},
        {"choice": []},
        {"choice": ["a", 3]},
        {"json_object": "yes"},
    ],
)
def test_structured_outputs_needs_exactly_one_valid_constraint(kwargs):
    from pagedllm.sampling_params import StructuredOutputsParams

    with pytest.raises(ValueError, match=r"^structured_outputs"):
        StructuredOutputsParams(**kwargs)


def test_structured_outputs_from_a_dict_and_its_cache_key():
    params = SamplingParams(structured_outputs={"json": '{"type": "object"}'})
    assert params.structured_outputs.kind == "json"
    assert params.structured_outputs.spec == '{"type": "object"}'
    with pytest.raises(ValueError, match=r"^structured_outputs must be None with beam search"):
        SamplingParams(use_beam_search=True, best_of=2, temperature=0.0, structured_outputs={"regex": "a"})
