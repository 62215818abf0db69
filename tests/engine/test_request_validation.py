"""The engine refuses, with a ValueError naming the field, every request it could not run, and
stays usable afterwards: the next request runs and no block leaks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams

MAX_NUM_SEQS = 4
MAX_MODEL_LEN = 64
VOCAB = 160


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    return LLM(
        tiny_llama_dir, device="cpu", max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS, num_kv_blocks=8
    )


@pytest.mark.parametrize(
    "prompt_token_ids, kwargs, field",
    [
        ([1, 2, VOCAB], {}, "prompt token id"),
        ([1, 10**30], {}, "prompt token id"),
        ([1, -1], {}, "prompt token id"),
        ([1, "2"], {}, "prompt token id"),
        ([], {}, "prompt_token_ids is empty"),
        ([1], {"stop_token_ids": [VOCAB], "min_tokens": 2}, "stop_token_ids"),
        ([1], {"stop_token_ids": [10**30]}, "stop_token_ids"),
        ([1], {"allowed_token_ids": [5, VOCAB]}, "allowed_token_ids"),
        ([1], {"logit_bias": {str(VOCAB): 1.0}}, "logit_bias"),
        ([1], {"n": MAX_NUM_SEQS + 1, "temperature": 1.0}, "n"),
        ([1], {"n": 1, "best_of": MAX_NUM_SEQS + 1, "temperature": 1.0}, "best_of"),
        ([1], {"use_beam_search": True, "best_of": 4, "temperature": 0.0, "max_tokens": 60}, "best_of"),
        ([1, 2, 3], {"min_tokens": MAX_MODEL_LEN, "max_tokens": None}, "min_tokens"),
        ([1], {"bad_words": ["x"]}, "bad_words"),
    ],
)
def test_refused_requests_name_the_field_and_leave_the_engine_usable(llm, prompt_token_ids, kwargs, field):
    with pytest.raises(ValueError, match=field):
        llm.generate(
            prompt_token_ids=prompt_token_ids, sampling_params=SamplingParams(**kwargs), use_tqdm=False
        )
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    [output] = llm.generate(
        prompt_token_ids=[1, 2, 3],
        sampling_params=SamplingParams(temperature=0.0, max_tokens=3),
        use_tqdm=False,
    )
    assert len(output.outputs[0].token_ids) == 3
    assert engine.scheduler.kv_cache_manager.get_num_free_gpu_blocks() == engine.num_gpu_blocks


@pytest.mark.parametrize(
    "field, value", [("temperature", -1.0), ("top_p", 0.0), ("max_tokens", 0), ("logit_bias", {"\u00b2": 1})]
)
def test_a_sampling_params_changed_after_it_was_made_is_checked_again(llm, field, value):
    params = SamplingParams(temperature=0.5, max_tokens=3)
    setattr(params, field, value)
    with pytest.raises(ValueError, match=rf"^prompt 0: {field} must be"):
        llm.generate(prompt_token_ids=[1, 2, 3], sampling_params=params, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_a_changed_n_takes_the_default_best_of_along(llm):
    params = SamplingParams(temperature=1.0, max_tokens=2, seed=0)
    params.n = 3  # best_of was left to default to n: it follows
    [output] = llm.generate(prompt_token_ids=[1, 2, 3], sampling_params=params, use_tqdm=False)
    assert params.best_of == 3 and len(output.outputs) == 3
    explicit = SamplingParams(temperature=1.0, max_tokens=2, best_of=2)
    explicit.n = 3  # best_of was given: it stays, and is now too small
    with pytest.raises(ValueError, match=r"^prompt 0: best_of must be an integer >= n \(3\)"):
        llm.generate(prompt_token_ids=[1, 2, 3], sampling_params=explicit, use_tqdm=False)


def test_sampling_params_of_another_type_is_refused(llm):
    with pytest.raises(ValueError, match="sampling_params must be a SamplingParams"):
        llm.llm_engine.add_request("x", prompt_token_ids=[1], sampling_params={"temperature": 0})


def test_numpy_and_torch_prompt_ids_are_token_ids(llm):
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    as_lists = llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=params, use_tqdm=False)
    as_arrays = llm.generate(
        prompt_token_ids=[np.array([5, 6, 7]), torch.tensor([5, 6, 7])],
        sampling_params=params,
        use_tqdm=False,
    )
    assert [o.outputs[0].token_ids for o in as_arrays] == [as_lists[0].outputs[0].token_ids] * 2


def test_truncate_prompt_tokens_keeps_the_last_ones(llm):
    params = SamplingParams(temperature=0.0, max_tokens=2, truncate_prompt_tokens=3)
    [output] = llm.generate(prompt_token_ids=[9, 8, 7, 6, 5], sampling_params=params, use_tqdm=False)
    assert output.prompt_token_ids == [7, 6, 5]


def test_seed_at_the_generators_limits_runs(llm):
    for seed in (2**64 - 1, -(2**63)):
        params = SamplingParams(temperature=1.0, max_tokens=2, seed=seed)
        [output] = llm.generate(prompt_token_ids=[1, 2], sampling_params=params, use_tqdm=False)
        assert len(output.outputs[0].token_ids) == 2
