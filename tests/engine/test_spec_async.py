"""Speculative decoding with asynchronous scheduling changes nothing the user sees.

With ``async_scheduling`` the core schedules step N + 1 before step N's verification reaches the
host: it counts N's drafts as accepted, schedules placeholders for the drafts the worker proposed
after N (they stay on the device), and corrects when N's output arrives; the worker moves N + 1's
tokens back by N's rejected drafts. Every test runs the same requests with a draft model and an
EAGLE-3 head through a synchronous and an asynchronous engine (CPU, float32) and compares what
comes out with each other and with HF ``generate``; ``assert_ran_ahead`` checks that the
asynchronous engine did launch steps over unverified drafts. (The uniproc CPU executor computes
a step when it is launched, so what runs ahead here is the core: its placeholders, optimistic
counts and corrections; at TP=2 the ranks' processes run the step while the core schedules.)
"""

from __future__ import annotations

import pytest
from test_spec_decode import TIGHT, assert_all_blocks_free, make_llm, mixed_prompts, token_ids
from test_spec_draft_model import draft_config, perturbed_copy
from test_spec_eagle import make_head
from test_spec_tensor_parallel import TARGET as TP_TARGET
from test_spec_tensor_parallel import drafter as tp_drafter
from transformers import LlamaConfig

from pagedllm import LLM, SamplingParams
from pagedllm.step_io import SchedulerOutput


@pytest.fixture(scope="module")
def target(make_tiny_model_for_module):
    return make_tiny_model_for_module(
        LlamaConfig, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2
    )


@pytest.fixture(scope="module")
def drafters(target, tmp_path_factory) -> dict[str, dict]:
    """name -> speculative_config: a perturbed copy of the target as a draft model (it agrees
    often, not always: drafts are rejected), and an EAGLE-3 head with a smaller vocabulary."""
    hf_model, model_config = target
    spec, *_ = make_head(tmp_path_factory, model_config, "eagle3-draft-vocab", seed=1)
    perturbed = perturbed_copy(hf_model, tmp_path_factory.mktemp("perturbed"), 0.3)
    return {"draft_model": draft_config(perturbed), "eagle3": spec}


class RecordingVerifier:
    """The worker's DraftVerifier, recording the drafts of each verification per request."""

    def __init__(self, verifier, verified: dict[int, list[list[int]]]) -> None:
        self.verifier = verifier
        self.verified = verified

    def __call__(self, logits, rows, drafts):
        for req_id, k, ids in zip(rows.req_ids, rows.num_drafts.tolist(), drafts.tolist()):
            self.verified.setdefault(req_id, []).append(ids[:k])
        return self.verifier(logits, rows, drafts)

    def __getattr__(self, name: str):
        return getattr(self.verifier, name)


class StepLog:
    """Wraps the executor: per launched step, whether a step was in flight and the requests whose
    computed count the scheduler took on trust (drafts in flight counted as accepted)."""

    def __init__(self, llm: LLM) -> None:
        engine = llm.llm_engine
        self.core = engine.engine_core
        self.launched_over_flight = 0
        self.optimistic = 0
        # req_id -> the drafts of each of its verifications, in order, as the verifier got them.
        self.verified: dict[int, list[list[int]]] = {}
        execute = engine.executor.execute_model
        runner = engine.executor.worker.model_runner
        runner.verifier = RecordingVerifier(runner.verifier, self.verified)

        def record(scheduler_output: SchedulerOutput):
            self.launched_over_flight += bool(self.core._in_flight)
            self.optimistic += len(scheduler_output.optimistic_req_ids)
            return execute(scheduler_output)

        engine.executor.execute_model = record
        # Steps whose optimistic counts the worker moved back on the device, unwaited.
        self.taken_back_on_device = 0
        take_back = runner._take_back

        def counting(model_input):
            self.taken_back_on_device += 1
            return take_back(model_input)

        runner._take_back = counting

    def assert_ran_ahead(self) -> None:
        assert self.core.max_in_flight == 1
        assert self.launched_over_flight > 0, "no step was launched while another was in flight"
        assert self.optimistic > 0, "no step was scheduled over drafts in flight"
        assert self.taken_back_on_device > 0, "no step's rejections were taken back on the device"


def counters(llm: LLM) -> tuple:
    stats = llm.llm_engine.get_stats().spec_decoding
    return (
        stats.num_drafts,
        stats.num_draft_tokens,
        stats.num_accepted_tokens,
        stats.num_accepted_tokens_per_pos,
    )


def run_both(
    model_config, spec: dict, prompts, params, same_steps: bool = True, **kwargs
) -> tuple[list, list, list[LLM]]:
    """The requests through a synchronous and an asynchronous engine; every block free after.
    With ``same_steps`` (a cache with room for every draft), each request's verifications must
    have been handed the same drafts by both: the placeholders the asynchronous scheduler sent
    were resolved to the drafter's proposals (a request a token stopped may have verified once
    more, in the step launched before its stop was seen). Under cache pressure the two engines
    drop drafts in different steps (the asynchronous one holds blocks for drafts in flight)."""
    results, llms, logs = [], [], []
    for async_scheduling in (False, True):
        llm = make_llm(model_config, async_scheduling=async_scheduling, speculative_config=spec, **kwargs)
        logs.append(StepLog(llm))
        results.append(llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False))
        assert_all_blocks_free(llm)
        llms.append(llm)
    logs[1].assert_ran_ahead()
    if not same_steps:
        return results[0], results[1], llms
    sync_verified, async_verified = logs[0].verified, logs[1].verified
    assert set(sync_verified) <= set(async_verified)
    for req_id, drafts in async_verified.items():
        expected = sync_verified.get(req_id, [])
        assert drafts[: len(expected)] == expected and len(drafts) - len(expected) <= 1
    return results[0], results[1], llms


def cut_requests(plain: list[list[int]]) -> tuple[list[SamplingParams], list[list[int]]]:
    """Six greedy requests' params, given each one's plain greedy tokens (20 of them): max_tokens
    cuts (inside a verified run too), a stop token id and logprobs; and the tokens each must give."""
    params = [
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop_token_ids=[plain[2][9]]),
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=13, ignore_eos=True),
    ]
    expected = [tokens[: p.max_tokens] for tokens, p in zip(plain, params)]
    expected[2] = plain[2][: plain[2].index(plain[2][9]) + 1]
    return params, expected


def completions(outputs) -> list[list[tuple]]:
    return [[(c.token_ids, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outputs]


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["draft_model", "eagle3"])
def test_greedy_output_and_acceptance_are_the_synchronous_runs_and_hfs(
    target, drafters, hf_greedy_tokens, drafter
):
    """A ragged batch with max_tokens cuts (inside a verified run too), stop token ids and
    logprobs: the same tokens, logprobs and acceptance counters as the synchronous engine."""
    hf_model, model_config = target
    prompts = mixed_prompts(6, model_config.vocab_size, seed=5)
    plain = [hf_greedy_tokens(hf_model, prompt, 20) for prompt in prompts]
    params, expected = cut_requests(plain)
    sync_out, async_out, llms = run_both(model_config, drafters[drafter], prompts, params, block_size=4)
    assert completions(async_out) == completions(sync_out)
    assert token_ids(async_out) == expected
    for got, want in zip(async_out[3].outputs[0].logprobs, sync_out[3].outputs[0].logprobs):
        assert got.keys() == want.keys()
        for token in got:
            assert got[token].logprob == pytest.approx(want[token].logprob, abs=1e-5)
    assert counters(llms[1]) == counters(llms[0])
    _, num_draft_tokens, num_accepted, _ = counters(llms[1])
    assert num_accepted < num_draft_tokens, "the test must reject drafts"
    if drafter == "draft_model":  # the random head's drafts are all rejected
        assert num_accepted > 0, "the test must accept drafts"


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["draft_model", "eagle3"])
def test_preemption_prefix_caching_and_chunked_prefill_change_no_output(target, drafters, drafter):
    """A cache too small for the batch (recomputation), prompts sharing a prefix run twice (prefix
    cache hits), 16-token steps (chunked prompts): the synchronous engine's greedy output."""
    _, model_config = target
    shared = mixed_prompts(1, model_config.vocab_size, seed=3)[0][:12]
    prompts = [shared + p for p in mixed_prompts(8, model_config.vocab_size, seed=1)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    expected = token_ids(
        make_llm(model_config, block_size=4).generate(
            prompt_token_ids=prompts, sampling_params=params, use_tqdm=False
        )
    )
    tight = make_llm(model_config, **TIGHT, async_scheduling=True, speculative_config=drafters[drafter])
    log = StepLog(tight)
    for _ in range(2):  # the second run finds the first one's blocks in the prefix cache
        outputs = tight.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        assert token_ids(outputs) == expected
    log.assert_ran_ahead()
    stats = tight.llm_engine.get_stats()
    assert stats.num_preemptions_recompute > 0
    assert stats.prefix_cache_hit_rate > 0
    assert stats.spec_decoding.num_accepted_tokens < stats.spec_decoding.num_draft_tokens
    assert_all_blocks_free(tight)


@pytest.mark.slow
def test_swapped_groups_change_no_output(target, drafters, hf_greedy_tokens):
    """Groups of n = 2 siblings swapped out and in when the cache runs short, some with a
    verification in flight. top_k=1 makes their sampling the argmax whatever the draws (a seeded
    sampled output depends on the steps' drafts, which cache pressure changes), so every sibling's
    tokens are HF's greedy ones."""
    hf_model, model_config = target
    prompts = mixed_prompts(6, model_config.vocab_size, seed=6)
    params = [
        SamplingParams(n=2 if i % 2 == 0 else 1, temperature=0.8, top_k=1, max_tokens=24, ignore_eos=True)
        for i in range(len(prompts))
    ]
    sync_out, async_out, llms = run_both(
        model_config,
        drafters["draft_model"],
        prompts,
        params,
        same_steps=False,
        block_size=4,
        num_kv_blocks=40,
        swap_space=1.0,
        max_model_len=96,
    )
    assert completions(async_out) == completions(sync_out)
    for output, prompt in zip(async_out, prompts):
        expected = hf_greedy_tokens(hf_model, prompt, 24)
        assert [c.token_ids for c in output.outputs] == [expected] * len(output.outputs)
    stats = llms[1].llm_engine.get_stats()
    assert stats.num_preemptions_swap > 0
    assert stats.spec_decoding.num_draft_tokens > 0


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["draft_model", "eagle3"])
def test_a_seeded_sampled_request_draws_the_same_tokens(target, drafters, drafter):
    _, model_config = target
    prompts = mixed_prompts(2, model_config.vocab_size, seed=7)
    params = SamplingParams(temperature=1.0, top_k=20, seed=11, max_tokens=24, ignore_eos=True)
    sync_out, async_out, llms = run_both(model_config, drafters[drafter], prompts, params, block_size=4)
    assert token_ids(async_out) == token_ids(sync_out)
    assert counters(llms[1]) == counters(llms[0])
    assert counters(llms[1])[1] > 0


@pytest.mark.slow
def test_an_abort_while_a_verification_is_in_flight_leaves_the_rest_unchanged(target, drafters):
    _, model_config = target
    prompts = mixed_prompts(4, model_config.vocab_size, seed=8)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    finals = []
    for async_scheduling in (False, True):
        llm = make_llm(
            model_config,
            block_size=4,
            async_scheduling=async_scheduling,
            speculative_config=drafters["eagle3"],
        )
        engine = llm.llm_engine
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), sampling_params=params, prompt_token_ids=prompt)
        seen: dict[str, list] = {}
        for step in range(60):
            if step == 3:
                if async_scheduling:  # the abort lands between a verification's launch and its output
                    assert any(s.scheduled_spec_decode_tokens for s, _ in engine.engine_core._in_flight)
                engine.abort_request(["1"])
            for output in engine.step():
                seen.setdefault(output.request_id, []).append(output)
            if not engine.has_unfinished_requests():
                break
        assert_all_blocks_free(llm)
        assert all(not o.finished for o in seen.get("1", []))
        finals.append({rid: outs[-1].outputs[0].token_ids for rid, outs in seen.items() if outs[-1].finished})
    assert finals[0] == finals[1]
    assert set(finals[1]) == {"0", "2", "3"}


@pytest.mark.slow
def test_stop_strings_end_requests_beside_speculating_ones(tiny_llama_with_tokenizer):
    """Stop strings are matched on text by the frontend (those requests decode without drafts,
    beside requests that speculate): with the model as its own draft, the same text."""
    model = tiny_llama_with_tokenizer
    first = LLM(model, device="cpu").generate(
        prompt_token_ids=[[100, 200, 300, 400], [500, 600, 700]],
        sampling_params=SamplingParams(temperature=0.0, max_tokens=24),
        use_tqdm=False,
    )
    text = first[0].outputs[0].text
    params = [
        SamplingParams(temperature=0.0, max_tokens=24, stop=[text[6:9]]),
        SamplingParams(temperature=0.0, max_tokens=24),
    ]
    outs = []
    for async_scheduling in (False, True):
        llm = LLM(
            model, device="cpu", async_scheduling=async_scheduling, speculative_config=draft_config(model)
        )
        outs.append(
            llm.generate(
                prompt_token_ids=[[100, 200, 300, 400], [500, 600, 700]],
                sampling_params=params,
                use_tqdm=False,
            )
        )
        assert llm.llm_engine.get_stats().spec_decoding.num_draft_tokens > 0
        assert_all_blocks_free(llm)
    summaries = [
        [(o.outputs[0].text, o.outputs[0].finish_reason, o.outputs[0].stop_reason) for o in out]
        for out in outs
    ]
    assert summaries[0] == summaries[1]
    assert summaries[1][0][1] == "stop" and summaries[1][0][0] == text[: text.index(text[6:9])]
    assert summaries[1][1][0] == first[1].outputs[0].text


def test_ngram_drafts_on_the_device_change_no_output(target, hf_greedy_tokens):
    """N-gram drafts looked up by the worker (asynchronous scheduling): a ragged batch of
    repetitive and random prompts with max_tokens cuts, a stop token and logprobs, through a cache
    too small for it (preemption), prefix caching and chunked prefill, run twice (the second run
    hits the first one's blocks): HF's greedy tokens, the synchronous host lookup's completions and
    logprobs, drafts accepted and rejected, every block free."""
    hf_model, model_config = target
    shared = mixed_prompts(1, model_config.vocab_size, seed=3)[0][:12]
    prompts = [shared + p for p in mixed_prompts(6, model_config.vocab_size, seed=5)]
    plain = [hf_greedy_tokens(hf_model, prompt, 20) for prompt in prompts]
    params, expected = cut_requests(plain)
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    outputs = []
    for async_scheduling in (False, True):
        llm = make_llm(model_config, **TIGHT, async_scheduling=async_scheduling, speculative_config=ngram)
        log = StepLog(llm)
        for _ in range(2):
            out = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
            assert token_ids(out) == expected
        assert_all_blocks_free(llm)
        outputs.append(out)
    log.assert_ran_ahead()
    assert completions(outputs[1]) == completions(outputs[0])
    for got, want in zip(outputs[1][3].outputs[0].logprobs, outputs[0][3].outputs[0].logprobs):
        assert got.keys() == want.keys()
        for token in got:
            assert got[token].logprob == pytest.approx(want[token].logprob, abs=1e-5)
    stats = llm.llm_engine.get_stats()
    assert stats.num_preemptions_recompute > 0 and stats.prefix_cache_hit_rate > 0
    assert 0 < stats.spec_decoding.num_accepted_tokens < stats.spec_decoding.num_draft_tokens


@pytest.mark.slow
@pytest.mark.parametrize("name", ["draft_model", "eagle3", "ngram"])
def test_two_tensor_parallel_ranks_run_ahead_as_one(
    make_tiny_model_for_module, tmp_path_factory, hf_greedy_tokens, name
):
    """TP=2 (the "mp" executor: the ranks run the step while the core schedules the next):
    greedy output through preemption, prefix caching and chunked prefill is HF's."""
    target = make_tiny_model_for_module(LlamaConfig, **TP_TARGET)
    hf_model, model_config = target
    spec = tp_drafter(name, target, tmp_path_factory)
    shared = mixed_prompts(1, model_config.vocab_size, seed=3)[0][:12]
    prompts = [shared + p for p in mixed_prompts(7, model_config.vocab_size, seed=1)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    llm = make_llm(
        model_config, **TIGHT, async_scheduling=True, speculative_config=spec, tensor_parallel_size=2
    )
    try:
        assert llm.llm_engine.engine_core.max_in_flight == 1
        outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        assert token_ids(outputs) == [hf_greedy_tokens(hf_model, p, 16) for p in prompts]
        stats = llm.llm_engine.get_stats()
        assert stats.num_preemptions_recompute > 0 and stats.spec_decoding.num_draft_tokens > 0
        assert_all_blocks_free(llm)
    finally:
        llm.llm_engine.shutdown()
