"""Asynchronous scheduling changes nothing the user sees.

With ``async_scheduling`` the engine launches step N + 1 before it has seen step N's samples;
a request that stops at step N may have one more token computed, which must never show. Every
test runs the same requests through a synchronous and an asynchronous engine (torch backend,
float32, CPU) and compares what comes out.
"""

from __future__ import annotations

import pickle
import random

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.step_io import SchedulerOutput


@pytest.fixture(scope="module")
def model_dir(tiny_llama_with_tokenizer) -> str:
    return tiny_llama_with_tokenizer


def make_llm(model_dir: str, async_scheduling: bool, **kwargs) -> LLM:
    return LLM(
        model_dir, device="cpu", attention_backend="torch", async_scheduling=async_scheduling, **kwargs
    )


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(rng.randint(3, 30))] for _ in range(n)]


def summary(outputs) -> list[list[tuple]]:
    return [
        [(c.index, c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outputs
    ]


def assert_all_blocks_free(engine: LLMEngine) -> None:
    kv = engine.scheduler.kv_cache_manager
    assert not engine.has_unfinished_requests()
    assert kv.get_num_free_gpu_blocks() == kv.num_total_gpu_blocks
    assert kv.get_num_free_cpu_blocks() == kv.num_total_cpu_blocks


def run_both(model_dir: str, params, ids, **kwargs) -> tuple[list, list, list[LLM]]:
    results = []
    llms = []
    for async_scheduling in (False, True):
        llm = make_llm(model_dir, async_scheduling, **kwargs)
        results.append(llm.generate(prompt_token_ids=ids, sampling_params=params, use_tqdm=False))
        assert_all_blocks_free(llm.llm_engine)
        llms.append(llm)
    return results[0], results[1], llms


def test_greedy_with_stop_strings_stop_tokens_eos_and_lengths(model_dir, smollm2_tokenizer):
    ids = prompts(8)
    sync_llm = make_llm(model_dir, False)
    # Stop strings and tokens the model actually produces: taken from a first greedy run.
    first = sync_llm.generate(
        prompt_token_ids=ids, sampling_params=SamplingParams(temperature=0, max_tokens=24), use_tqdm=False
    )
    params = []
    for i, output in enumerate(first):
        text, tokens = output.outputs[0].text, output.outputs[0].token_ids
        if i % 4 == 0 and len(text) > 8:
            params.append(SamplingParams(temperature=0, max_tokens=24, stop=[text[5:8]]))
        elif i % 4 == 1 and len(tokens) > 6:
            params.append(SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[tokens[5]]))
        elif i % 4 == 2:
            params.append(SamplingParams(temperature=0, max_tokens=3 + i))
        else:
            params.append(
                SamplingParams(temperature=0, max_tokens=24, min_tokens=4, stop_token_ids=[tokens[1]])
            )
    sync_out, async_out, _ = run_both(model_dir, params, ids)
    assert summary(sync_out) == summary(async_out)
    reasons = {c.finish_reason for o in async_out for c in o.outputs}
    assert reasons == {"stop", "length"}
    assert any(isinstance(c.stop_reason, str) for o in async_out for c in o.outputs)
    for output, p in zip(async_out, params):
        assert len(output.outputs[0].token_ids) <= p.max_tokens


@pytest.mark.slow
def test_n_best_of_seeded_and_beam_search(model_dir):
    ids = prompts(4, seed=1)
    sampled = SamplingParams(n=3, best_of=4, temperature=0.9, seed=11, max_tokens=10, logprobs=2)
    sync_out, async_out, _ = run_both(model_dir, sampled, ids)
    assert summary(sync_out) == summary(async_out)
    assert all(len(o.outputs) == 3 for o in async_out)
    beams = SamplingParams(n=2, best_of=3, use_beam_search=True, temperature=0, max_tokens=8)
    sync_out, async_out, _ = run_both(model_dir, beams, ids)
    assert summary(sync_out) == summary(async_out)


# Slow (~11 s): grammars compiled and matched for every request, synchronous and asynchronous.
@pytest.mark.slow
def test_grammars_and_bad_words_change_nothing_and_need_no_wait(model_dir):
    """The worker keeps the output history a grammar or bad words read from its own samples: the
    engine does not wait for the host between their steps, and the outputs are the synchronous
    ones (also through preemption, which resends a request in full)."""
    ids = prompts(8, seed=5)
    choice = StructuredOutputsParams(choice=["alpha beta", "gamma", "delta epsilon zeta"])
    params = []
    for i in range(len(ids)):
        kind = i % 4
        params.append(
            SamplingParams(
                temperature=0.9,
                seed=i,
                max_tokens=24,
                n=2 if i == 4 else 1,
                structured_outputs=(
                    StructuredOutputsParams(json_object=True) if kind == 0 else choice if kind == 1 else None
                ),
                bad_words=["the", "a"] if kind == 2 else None,
            )
        )
    sync_out, async_out, llms = run_both(
        model_dir, params, ids, block_size=4, num_kv_blocks=44, max_model_len=128
    )
    assert summary(sync_out) == summary(async_out)
    assert llms[1].llm_engine.get_stats().num_preemptions_recompute > 0
    for output, p in zip(async_out, params):
        for completion in output.outputs:
            if p.structured_outputs is choice:
                assert completion.text in choice.choice
    engine = llms[1].llm_engine
    engine.add_request("grammar", sampling_params=params[0], prompt_token_ids=ids[0])
    for _ in range(3):
        engine.step()
        assert not engine.scheduler.has_requests_needing_host()
    engine.abort_request("grammar")
    while engine.has_unfinished_requests():
        engine.step()


@pytest.mark.parametrize("num_cpu_blocks_gib", [0.0, 1.0])
def test_preemption_by_recompute_and_swap_changes_nothing(model_dir, num_cpu_blocks_gib):
    ids = prompts(10, seed=2)
    params = [
        SamplingParams(n=2 if i % 3 == 0 else 1, temperature=0.8 if i % 3 == 0 else 0, seed=i, max_tokens=30)
        for i in range(len(ids))
    ]
    reference = make_llm(model_dir, False).generate(
        prompt_token_ids=ids, sampling_params=params, use_tqdm=False
    )
    sync_out, async_out, llms = run_both(
        model_dir,
        params,
        ids,
        block_size=4,
        num_kv_blocks=40,
        swap_space=num_cpu_blocks_gib,
        max_model_len=128,
    )
    assert summary(sync_out) == summary(reference) == summary(async_out)
    stats = llms[1].llm_engine.get_stats()
    assert stats.num_preemptions_recompute > 0
    if num_cpu_blocks_gib:
        assert stats.num_preemptions_swap > 0


def test_aborts_in_flight_leave_the_rest_unchanged(model_dir):
    ids = prompts(6, seed=3)
    params = SamplingParams(temperature=0, max_tokens=16)
    finals = []
    for async_scheduling in (False, True):
        engine = make_llm(model_dir, async_scheduling).llm_engine
        for i, prompt in enumerate(ids):
            engine.add_request(str(i), sampling_params=params, prompt_token_ids=prompt)
        seen: dict[str, list] = {}
        for step in range(40):
            if step == 3:
                engine.abort_request(["1", "4"])
            for output in engine.step():
                seen.setdefault(output.request_id, []).append(output)
            if not engine.has_unfinished_requests():
                break
        assert_all_blocks_free(engine)
        # Nothing of an aborted request comes out after its abort, and it never finishes.
        assert all(not o.finished for rid in ("1", "4") for o in seen.get(rid, []))
        finals.append({rid: summary([outs[-1]]) for rid, outs in seen.items() if outs[-1].finished})
    assert finals[0] == finals[1]
    assert set(finals[1]) == {"0", "2", "3", "5"}


def test_a_decode_step_message_is_small(model_dir):
    """A step of 256 decoding requests sends diffs: no token lists, no whole block tables."""
    engine = make_llm(model_dir, False, max_num_seqs=256, max_model_len=256).llm_engine
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    for i, prompt in enumerate(prompts(256, seed=4)):
        engine.add_request(str(i), sampling_params=params, prompt_token_ids=prompt)
    sent: list[SchedulerOutput] = []
    execute = engine.executor.execute_model

    def record(scheduler_output):
        sent.append(scheduler_output)
        return execute(scheduler_output)

    engine.executor.execute_model = record
    for _ in range(6):
        engine.step()
    decode = sent[-1]
    assert len(decode.num_scheduled_tokens) == 256 and not decode.scheduled_new_reqs
    size = len(pickle.dumps(decode))
    assert size < 12_000, f"a 256-request decode step pickles to {size} bytes"
    engine.executor.execute_model = execute
    engine.abort_request([str(i) for i in range(256)])
    engine.step()
