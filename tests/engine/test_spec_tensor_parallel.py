"""Speculative decoding under tensor parallelism on the CPU (gloo, float32, the "mp" executor): the
draft model or EAGLE head is sharded over the target's two ranks (worker/draft_model.py).

For a draft model and EAGLE-3 and EAGLE heads, in ragged batches mixing repetitive and random
prompts, through preemption, prefix caching and chunked prefill:

* greedy output at TP=2 is HF ``generate``'s (the oracle) and TP=1's with the same drafter;
* the drafts rank 0 returns each step are TP=1's drafts, step for step (the sharded drafter
  computes what the whole one does), so the acceptance counters are TP=1's too;
* seeded sampled output at TP=2 is TP=1's (every rank draws the same uniforms from the same
  seeds; TP=1's sampling is checked against the target's exact distribution in
  test_spec_draft_model.py and test_spec_eagle.py);
* a drafter whose heads or MLP do not split over the ranks is refused before loading.

The target has one KV head (replicated on both ranks); the EAGLE-3 head has two (one per rank)
and a draft vocabulary that does not split evenly.
"""

from __future__ import annotations

from collections import Counter

import pytest
from test_spec_decode import TIGHT, assert_all_blocks_free, make_llm, mixed_prompts, token_ids
from test_spec_draft_model import perturbed_copy
from test_spec_eagle import write_head
from transformers import LlamaConfig, Qwen2Config

from pagedllm import LLM, SamplingParams
from tests.executor.reductions import all_deferred, deferred_reductions, none_deferred

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
# Two sequences per prompt, a seed each: the rejection sampler's uniforms come from the generators.
SAMPLED = SamplingParams(n=2, temperature=0.8, top_p=0.9, seed=11, max_tokens=8, ignore_eos=True)
TARGET = {"num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 1}


@pytest.fixture(scope="module")
def target(make_tiny_model_for_module):
    return make_tiny_model_for_module(LlamaConfig, **TARGET)


def drafter(name: str, target, tmp_path_factory) -> dict:
    if name == "ngram":  # no model: with asynchronous scheduling every rank looks drafts up
        return {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    hf_model, model_config = target
    directory = tmp_path_factory.mktemp(name)
    if name == "draft_model":  # the target plus noise: accepted often, not always
        model = perturbed_copy(hf_model, directory, 0.3)
    elif name == "eagle3":
        model, *_ = write_head(directory, model_config.hf_config, "eagle3", 97, seed=1)
    else:
        model, *_ = write_head(directory, model_config.hf_config, "eagle", seed=1, num_key_value_heads=1)
    return {"method": name, "model": model, "num_speculative_tokens": 3}


def record_drafts(llm: LLM) -> list[dict[int, tuple[int, list[int]]]]:
    """The drafts each step's output brings the scheduler (rank 0's at TP=2), step by step: req_id
    -> (the length of the context they continue, the drafts)."""
    scheduler = llm.llm_engine.scheduler
    proposals = scheduler.spec_decoding.drafter
    calls: list[dict[int, tuple[int, list[int]]]] = []
    receive = proposals.receive

    def recording(output):
        # Received before the step's samples are applied: the context grows by its rows.
        added = Counter(output.req_ids)
        requests = scheduler.queues.requests
        calls.append(
            {
                req_id: (requests[req_id].num_tokens + added[req_id], list(ids))
                for req_id, ids in output.draft_token_ids.items()
            }
        )
        receive(output)

    proposals.receive = recording
    return calls


def run(llm: LLM, prompts: list[list[int]]) -> dict:
    """Greedy (later prompts find the shared prefix's blocks in the cache), then sampled."""
    drafts = record_drafts(llm)
    greedy = token_ids(llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False))
    outputs = llm.generate(prompt_token_ids=prompts[:3], sampling_params=SAMPLED, use_tqdm=False)
    counters = llm.llm_engine.scheduler.spec_decoding
    stats = llm.llm_engine.get_stats()
    return {
        "greedy": greedy,
        "sampled": [[c.token_ids for c in o.outputs] for o in outputs],
        "drafts": drafts,
        "counters": (
            counters.num_drafts,
            counters.num_draft_tokens,
            counters.num_accepted_tokens,
            counters.num_accepted_tokens_per_pos,
        ),
        "preemptions": stats.num_preemptions_recompute,
        "prefix_hits": stats.prefix_cache_hit_rate,
    }


@pytest.mark.slow
@pytest.mark.parametrize("name", ["draft_model", "eagle3", "eagle"])
def test_two_ranks_draft_verify_and_sample_as_one(target, tmp_path_factory, hf_greedy_tokens, name):
    hf_model, model_config = target
    spec = drafter(name, target, tmp_path_factory)
    shared = mixed_prompts(1, model_config.vocab_size, seed=3)[0][:12]
    prompts = [shared + p for p in mixed_prompts(7, model_config.vocab_size, seed=1)]
    expected = [hf_greedy_tokens(hf_model, prompt, GREEDY.max_tokens) for prompt in prompts]

    one = run(make_llm(model_config, **TIGHT, swap_space=0.01, speculative_config=spec), prompts)
    two_llm = make_llm(
        model_config, **TIGHT, swap_space=0.01, speculative_config=spec, tensor_parallel_size=2
    )
    try:
        assert two_llm.llm_engine.config.parallel_config.distributed_executor_backend == "mp"
        two = run(two_llm, prompts)
        assert_all_blocks_free(two_llm)
        # EAGLE-3's hooks read the target's layer outputs whole: its all-reduces stay in place.
        num_layers = model_config.hf_config.num_hidden_layers
        layout = none_deferred(num_layers) if name == "eagle3" else all_deferred(num_layers)
        assert two_llm.llm_engine.executor.collective_rpc(deferred_reductions) == [layout] * 2
    finally:
        two_llm.llm_engine.shutdown()

    assert one["greedy"] == expected
    assert two["greedy"] == expected
    assert two["drafts"] == one["drafts"]
    assert two["counters"] == one["counters"]
    assert two["sampled"] == one["sampled"]
    # The run exercised what it claims to: drafts verified and some accepted, preemption, hits.
    _, num_draft_tokens, num_accepted, _ = two["counters"]
    assert num_draft_tokens > 0 and (num_accepted > 0 or name != "draft_model")
    assert two["preemptions"] > 0 and two["prefix_hits"] > 0


def test_a_drafter_that_does_not_split_over_the_ranks_is_refused_before_loading(
    target, make_tiny_model, tmp_path, monkeypatch
):
    _, model_config = target
    # Three heads of 32 (hidden 96): splits over 1 or 3 ranks, where the target splits over 1, 2, 4.
    _, three_heads = make_tiny_model(
        Qwen2Config,
        vocab_size=model_config.vocab_size,
        hidden_size=96,
        num_attention_heads=3,
        num_key_value_heads=1,
    )
    # An EAGLE-3 head whose MLP (81 features) splits over no more than one rank.
    head, *_ = write_head(tmp_path / "head", model_config.hf_config, "eagle3", intermediate_size=81)

    def no_loading(*args, **kwargs):
        raise AssertionError("weights were read before the config was refused")

    monkeypatch.setattr("pagedllm.model_loader.get_model", no_loading)
    cases = [
        ("draft_model", three_heads.model, "num_attention_heads=3"),
        ("eagle3", head, "intermediate_size=81"),
    ]
    for method, path, detail in cases:
        spec = {"method": method, "model": path, "num_speculative_tokens": 3}
        message = rf"tensor_parallel_size .*speculative_config.model.*{detail}.*one of \[1\], got 2"
        with pytest.raises(ValueError, match=message):
            make_llm(model_config, tensor_parallel_size=2, speculative_config=spec)
