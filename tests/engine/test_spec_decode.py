"""Speculative decoding (n-gram drafts) end to end on the CPU, float32: greedy outputs are token
for token those of decoding without it and of HF ``generate``; sampled outputs follow the
target's exact distribution; bad configurations are refused before anything is loaded."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import logging
import random
from types import SimpleNamespace

import pytest
import torch
from transformers import (
    GptOssConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

from pagedllm import LLM, SamplingParams
from pagedllm.core.spec_decode import NgramProposer, SpecDecodingStats, WorkerProposals
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.metrics import EngineCollector, StatsLogger
from pagedllm.spec_config import SpeculativeConfig
from pagedllm.worker.ngram_drafter import NgramDrafter

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}

# The architectures of tests/engine/test_generation.py's HF-equality cases.
MODEL_CASES = {
    "llama-mha-tied": (
        LlamaConfig,
        {"num_attention_heads": 4, "num_key_value_heads": 4, "tie_word_embeddings": True},
    ),
    "llama-gqa2-head64": (LlamaConfig, {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}),
    "mistral-gqa4-head128": (
        MistralConfig,
        {"num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128, "sliding_window": None},
    ),
    "qwen2-bias": (Qwen2Config, {"num_attention_heads": 4, "num_key_value_heads": 2}),
    "qwen3-qknorm-head64": (
        Qwen3Config,
        {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64},
    ),
    "qwen3moe-top8": (
        Qwen3MoeConfig,
        {
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "num_experts": 16,
            "num_experts_per_tok": 8,
            "moe_intermediate_size": 32,
            "mlp_only_layers": [0],
        },
    ),
    "mixtral-top2": (
        MixtralConfig,
        {
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
        },
    ),
}


def mixed_prompts(n: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Half repetitive (a short motif repeated: n-gram drafts find matches and some are
    accepted), half random (few matches), of ragged lengths."""
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        if i % 2 == 0:
            motif = [rng.randrange(vocab_size) for _ in range(rng.randint(2, 6))]
            prompts.append((motif * 20)[: rng.randint(8, 40)])
        else:
            prompts.append([rng.randrange(vocab_size) for _ in range(rng.randint(1, 40))])
    return prompts


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


# A cache of 24 blocks of 4 tokens (fewer than 6 of the mixed requests need at once), prefix
# caching, and 16-token steps that cut prompts: preemption, cache hits and chunks in one engine.
TIGHT = dict(
    block_size=4,
    num_kv_blocks=24,
    max_model_len=96,
    enable_prefix_caching=True,
    enable_chunked_prefill=True,
    max_num_batched_tokens=16,
    max_num_seqs=6,
)


def make_llm(model_config, **kwargs) -> LLM:
    return LLM(model_config.model, device="cpu", **kwargs)


def assert_all_blocks_free(llm: LLM) -> None:
    kv = llm.llm_engine.scheduler.kv_cache_manager
    assert kv.get_num_free_gpu_blocks() == kv.num_total_gpu_blocks
    assert kv.get_num_requests_with_blocks() == 0


@pytest.fixture
def tiny_llama(make_tiny_model):
    return make_tiny_model(LlamaConfig, num_attention_heads=4, num_key_value_heads=2)


@pytest.mark.parametrize("case", list(MODEL_CASES))
def test_greedy_with_ngram_equals_hf_and_decoding_without_it(make_tiny_model, hf_greedy_tokens, case):
    config_class, overrides = MODEL_CASES[case]
    hf_model, model_config = make_tiny_model(config_class, **overrides)
    prompts = mixed_prompts(6, model_config.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    llm = make_llm(model_config, block_size=4, speculative_config=NGRAM)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert token_ids(outputs) == [hf_greedy_tokens(hf_model, prompt, 16) for prompt in prompts]
    spec = llm.llm_engine.scheduler.spec_decoding
    assert spec.num_draft_tokens > 0 and spec.num_accepted_tokens > 0, "the test must verify drafts"
    assert_all_blocks_free(llm)


def record_attention(llm: LLM) -> list[tuple[int, int, int]]:
    """Wrap the runner's input staging: per step (verified rows, decode sequences, tokens)."""
    runner = llm.llm_engine.executor.worker.model_runner
    steps = []
    prepare = runner.prepare_inputs

    def recording(scheduler_output):
        model_input = prepare(scheduler_output)
        num_tokens = len(model_input.input_ids)
        steps.append((model_input.num_verify_rows, model_input.attn_metadata.num_decodes, num_tokens))
        return model_input

    runner.prepare_inputs = recording
    return steps


# Windows on every layer (the cache drops the blocks behind them: cache positions are not
# positions), and a window beside learned sinks (gpt-oss): attention's sliding windows are per
# sequence, so a verification expanded into decodes keeps each token's own window.
_SMALL = {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "pad_token_id": 0}
WINDOW_CASES = {
    "phi3-window8": (Phi3Config, {**_SMALL, "sliding_window": 8, "bos_token_id": 1, "eos_token_id": 2}),
    "gptoss-sinks-window8": (
        GptOssConfig,
        {
            **_SMALL,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("case", list(WINDOW_CASES))
def test_verifications_run_as_decodes_and_keep_windows_and_sinks(
    make_tiny_model, hf_greedy_tokens, case, backend
):
    config_class, overrides = WINDOW_CASES[case]
    hf_model, model_config = make_tiny_model(config_class, **overrides)
    prompts = mixed_prompts(4, model_config.vocab_size, seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    llm = make_llm(model_config, block_size=4, attention_backend=backend, speculative_config=NGRAM)
    steps = record_attention(llm)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert token_ids(outputs) == [hf_greedy_tokens(hf_model, prompt, 20) for prompt in prompts]
    # Every verified token was a decode sequence of its own (batch expansion), and some steps were
    # decodes only, as a CUDA graph replays them.
    verify_steps = [step for step in steps if step[0]]
    assert verify_steps and all(decodes >= num_verify for num_verify, decodes, _ in verify_steps)
    assert any(decodes == num_tokens > len(prompts) for _, decodes, num_tokens in verify_steps)
    assert llm.llm_engine.scheduler.spec_decoding.num_accepted_tokens > 0


@pytest.mark.slow
def test_adapters_follow_their_requests_through_expanded_verifications(
    tiny_llama, make_adapter, peft_merged, hf_greedy_tokens
):
    """With LoRA, each token of a verification expanded into decodes carries its request's adapter."""
    from pagedllm.lora.request import LoRARequest

    hf_model, model_config = tiny_llama
    lora = LoRARequest("adapter", 1, make_adapter(hf_model, 8, ["q_proj", "v_proj", "down_proj"], alpha=32.0))
    prompts = mixed_prompts(4, model_config.vocab_size, seed=7)
    choices = [lora, None, lora, None]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    llm = make_llm(model_config, block_size=4, enable_lora=True, max_lora_rank=8, speculative_config=NGRAM)
    outputs = llm.generate(
        prompt_token_ids=prompts, sampling_params=params, lora_request=choices, use_tqdm=False
    )
    merged = peft_merged(hf_model, lora.lora_path)
    for prompt, choice, output in zip(prompts, choices, outputs):
        reference = merged if choice else hf_model
        assert output.outputs[0].token_ids == hf_greedy_tokens(reference, prompt, 16)
    assert outputs[0].outputs[0].token_ids != hf_greedy_tokens(hf_model, prompts[0], 16)
    assert llm.llm_engine.scheduler.spec_decoding.num_accepted_tokens > 0


def test_preemption_and_prefix_caching_with_ngram_change_no_output(tiny_llama):
    _, model_config = tiny_llama
    shared = mixed_prompts(1, model_config.vocab_size, seed=3)[0][:12]
    prompts = [shared + p for p in mixed_prompts(8, model_config.vocab_size, seed=1)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    roomy = make_llm(model_config, block_size=4)
    expected = token_ids(roomy.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False))
    # 40 blocks of 4 tokens: less than the 8 requests need at once; drafts need more slots still.
    tight = make_llm(
        model_config,
        block_size=4,
        num_kv_blocks=40,
        max_model_len=96,
        swap_space=0.01,
        enable_prefix_caching=True,
        speculative_config=NGRAM,
    )
    outputs = tight.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert token_ids(outputs) == expected
    stats = tight.llm_engine.get_stats()
    assert stats.num_preemptions_recompute > 0
    assert stats.prefix_cache_hit_rate > 0
    assert tight.llm_engine.scheduler.spec_decoding.num_accepted_tokens > 0
    # Again, now that the prefix cache holds the first run's blocks (registered from accepted
    # tokens only): the same outputs.
    again = tight.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert token_ids(again) == expected
    assert_all_blocks_free(tight)


@pytest.mark.slow
def test_chunked_prefill_and_a_small_token_budget_with_ngram_change_no_output(tiny_llama):
    _, model_config = tiny_llama
    prompts = mixed_prompts(6, model_config.vocab_size, seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    plain = make_llm(model_config, block_size=4)
    expected = token_ids(plain.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False))
    llm = make_llm(
        model_config,
        block_size=4,
        enable_chunked_prefill=True,
        max_num_batched_tokens=12,
        max_num_seqs=4,
        speculative_config=NGRAM,
    )
    assert (
        token_ids(llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)) == expected
    )
    assert_all_blocks_free(llm)


@pytest.mark.slow
def test_lengths_stop_tokens_min_tokens_and_logprobs_hold_with_ngram(tiny_llama):
    """Drafts are cut at max_tokens and the context; a stop token inside an accepted run ends the
    request there; min_tokens bans EOS at every verified position; logprobs are the emitted
    tokens'."""
    _, model_config = tiny_llama
    prompts = mixed_prompts(6, model_config.vocab_size, seed=4)
    prompts[1] = ([7, 8, 9] * 10)[:30]  # 30 + 30 tokens pass max_model_len
    plain = make_llm(model_config, block_size=4, max_model_len=48)
    spec = make_llm(model_config, block_size=4, max_model_len=48, speculative_config=NGRAM)
    free_run = token_ids(
        plain.generate(
            prompt_token_ids=prompts,
            sampling_params=SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
            use_tqdm=False,
        )
    )
    params = [
        SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),  # reaches max_model_len
        SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[free_run[2][6]], ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[free_run[3][1]], min_tokens=8),
        SamplingParams(temperature=0.0, max_tokens=20, logprobs=3, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=20, logprobs=0, ignore_eos=True),
    ]
    want = plain.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    got = spec.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].finish_reason == w.outputs[0].finish_reason
    assert len(got[0].outputs[0].token_ids) == 5
    assert len(prompts[1]) + len(got[1].outputs[0].token_ids) == 48
    for g, w in zip(got[4:], want[4:]):
        assert len(g.outputs[0].logprobs) == len(w.outputs[0].logprobs)
        for g_pos, w_pos in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
            assert g_pos.keys() == w_pos.keys()
            for token in g_pos:
                assert g_pos[token].logprob == pytest.approx(w_pos[token].logprob, abs=1e-4)
                assert g_pos[token].rank == w_pos[token].rank
    assert spec.llm_engine.scheduler.spec_decoding.num_accepted_tokens > 0
    assert_all_blocks_free(spec)


@pytest.mark.slow
def test_acceptance_is_counted_per_request_and_engine_wide(tiny_llama, caplog):
    _, model_config = tiny_llama
    prompts = mixed_prompts(6, model_config.vocab_size, seed=5)
    llm = make_llm(model_config, block_size=4, speculative_config=NGRAM)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    spec = llm.llm_engine.scheduler.spec_decoding
    assert sum(o.metrics.spec_num_draft_tokens for o in outputs) == spec.num_draft_tokens
    assert sum(o.metrics.spec_num_accepted_tokens for o in outputs) == spec.num_accepted_tokens
    assert sum(spec.num_accepted_tokens_per_pos) == spec.num_accepted_tokens
    # Position i is accepted only after every position before it.
    per_pos = spec.num_accepted_tokens_per_pos
    assert all(a >= b for a, b in itertools.pairwise(per_pos))
    # Each verification emits its accepted drafts and one token; the first token of each request
    # comes from its prompt, and steps without drafts give one each.
    num_outputs = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert num_outputs - len(outputs) >= spec.num_drafts + spec.num_accepted_tokens
    for o in outputs:
        rate = o.metrics.spec_acceptance_rate
        assert rate is None or 0.0 <= rate <= 1.0
    # /metrics: vLLM's counter names, per position too.
    stats = llm.llm_engine.get_stats()
    engine = SimpleNamespace(stats=stats, engine_stats=[stats], num_aborted_requests=0, num_failed_requests=0)
    samples = {
        (s.name, s.labels.get("position")): s.value
        for family in EngineCollector(engine, "tiny").collect()
        for s in family.samples
    }
    assert samples["pagedllm:spec_decode_num_draft_tokens_total", None] == spec.num_draft_tokens
    assert samples["pagedllm:spec_decode_num_accepted_tokens_total", None] == spec.num_accepted_tokens
    assert samples["pagedllm:spec_decode_num_drafts_total", None] == spec.num_drafts
    for position, value in enumerate(per_pos):
        assert samples["pagedllm:spec_decode_num_accepted_tokens_per_pos_total", str(position)] == value
    # The periodic stats line says the acceptance since the last one.
    stats = engine.stats
    before = dataclasses.replace(
        stats, num_generation_tokens=0, spec_decoding=SpecDecodingStats(0, 0, 0, [0] * 4)
    )
    stats_logger = StatsLogger(interval=0.0)
    with caplog.at_level(logging.INFO, logger="pagedllm.metrics"):
        stats_logger.log(before)
        stats_logger.log(stats)
    rate = 100 * spec.num_accepted_tokens / spec.num_draft_tokens
    assert f"acceptance rate {rate:.1f}%" in caplog.text


@pytest.mark.parametrize(
    "config, field",
    [
        ({"method": "eagle7"}, "speculative_config.method"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 17}, "speculative_config.num_speculative_tokens"),
        (
            {"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2},
            "speculative_config.prompt_lookup_max",
        ),
        ({"method": "ngram", "prompt_lookup_min": 0}, "speculative_config.prompt_lookup_min"),
        ({"method": "ngram", "disable_by_batch_size": 0}, "speculative_config.disable_by_batch_size"),
        ({"method": "ngram", "speculative_tokens": 3}, "unknown keys ['speculative_tokens']"),
        ({"num_speculative_tokens": 3}, "speculative_config.method is required"),
        ({"method": "draft_model"}, "speculative_config.model"),
        ({"method": "eagle3"}, "speculative_config.model"),
        ({"method": "medusa"}, "speculative_config.method 'medusa' is not supported yet"),
        ('{"method": "ngram", ', "speculative_config must be a JSON object"),
    ],
)
def test_bad_speculative_configs_are_refused_before_loading(config, field):
    # The model does not exist: the config is checked before anything is read.
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        LLM("/nonexistent/model", device="cpu", speculative_config=config)


def test_ngram_drafts_come_from_the_host_unless_scheduling_runs_ahead(tiny_llama):
    """Synchronous scheduling (the CPU's default): the scheduler looks drafts up in the tokens it
    has. Asynchronous: the worker does, on the device (the host lacks the newest tokens)."""
    _, model_config = tiny_llama
    for async_scheduling, host_side in ((False, NgramProposer), (True, WorkerProposals)):
        llm = make_llm(model_config, speculative_config=NGRAM, async_scheduling=async_scheduling)
        engine = llm.llm_engine
        assert engine.config.drafts_on_worker is async_scheduling
        assert type(engine.scheduler.spec_decoding.drafter) is host_side
        drafter = engine.executor.worker.model_runner.drafter
        assert (drafter is None) is not async_scheduling
        assert async_scheduling is isinstance(drafter, NgramDrafter)


def test_on_cuda_ngram_drafts_are_looked_up_on_the_device_by_default(tiny_llama, monkeypatch):
    """Asynchronous scheduling is CUDA's default with n-gram drafts too (the worker's lookup);
    the CPU's stays synchronous (the scheduler's)."""
    from pagedllm.engine import arg_utils

    _, model_config = tiny_llama
    args = EngineArgs(model=model_config.model, speculative_config=NGRAM)
    cpu = args.create_engine_config()
    assert not cpu.async_scheduling and not cpu.drafts_on_worker
    monkeypatch.setattr(arg_utils, "resolve_device", lambda *_: torch.device("cuda"))
    cuda = args.create_engine_config()
    assert cuda.async_scheduling and cuda.drafts_on_worker
    assert not dataclasses.replace(args, async_scheduling=False).create_engine_config().drafts_on_worker


def test_on_cuda_ngram_stops_drafting_at_the_measured_batch_size_unless_told(tiny_llama, monkeypatch, caplog):
    """n-gram on a GPU: no drafts from NGRAM_CUDA_DISABLE_BY_BATCH_SIZE running requests unless
    the user gave disable_by_batch_size (null: drafts at every batch size); no such default on
    the CPU or for a model drafter."""
    from pagedllm.engine import arg_utils
    from pagedllm.spec_config import NGRAM_CUDA_DISABLE_BY_BATCH_SIZE

    _, model_config = tiny_llama
    args = EngineArgs(model=model_config.model, speculative_config=NGRAM)
    assert args.create_engine_config().speculative_config.disable_by_batch_size is None  # CPU
    monkeypatch.setattr(arg_utils, "resolve_device", lambda *_: torch.device("cuda"))
    with caplog.at_level(logging.INFO, logger="pagedllm.spec_config"):
        spec = args.create_engine_config().speculative_config
    assert spec.disable_by_batch_size == NGRAM_CUDA_DISABLE_BY_BATCH_SIZE == 2
    assert "fewer than 2 requests run" in caplog.text  # the user is told at start
    for given in (None, 8):
        told = dataclasses.replace(
            args, speculative_config=json.dumps({**NGRAM, "disable_by_batch_size": given})
        )
        assert told.create_engine_config().speculative_config.disable_by_batch_size == given
    eagle = SpeculativeConfig(method="eagle3", model="head")
    assert eagle.with_device_defaults("cuda", {"method", "model"}) is eagle


def test_past_disable_by_batch_size_the_worker_s_lookup_makes_no_proposals(tiny_llama, hf_greedy_tokens):
    """Asynchronous scheduling (drafts looked up on the worker): after a step the scheduler did
    not draft for (2 or more running requests) the lookup does not run, and drafting resumes once
    one request is left, with HF's greedy tokens throughout."""
    hf_model, model_config = tiny_llama
    prompts = mixed_prompts(4, model_config.vocab_size, seed=2)
    # The first (repetitive) request outlives the others, which end after 3 tokens.
    params = [
        SamplingParams(temperature=0.0, max_tokens=24 if i == 0 else 3, ignore_eos=True) for i in range(4)
    ]
    llm = make_llm(
        model_config, async_scheduling=True, speculative_config={**NGRAM, "disable_by_batch_size": 2}
    )
    engine = llm.llm_engine
    runner = engine.executor.worker.model_runner
    steps: list[list] = []  # per step: [drafting, requests scheduled, lookups run]
    execute, propose = runner.execute_model, runner.drafter.propose

    def record_step(scheduler_output):
        steps.append([scheduler_output.drafting, len(scheduler_output.num_scheduled_tokens), 0])
        return execute(scheduler_output)

    def record_lookup(rows, newest):
        steps[-1][2] += 1
        return propose(rows, newest)

    runner.execute_model, runner.drafter.propose = record_step, record_lookup
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert token_ids(outputs) == [
        hf_greedy_tokens(hf_model, p, q.max_tokens) for p, q in zip(prompts, params)
    ]
    assert [lookups for drafting, _, lookups in steps if not drafting] == [0] * sum(not d for d, *_ in steps)
    assert any(not drafting and n >= 2 for drafting, n, _ in steps)
    assert any(drafting and lookups for drafting, _, lookups in steps)
    assert engine.scheduler.spec_decoding.num_draft_tokens > 0


# --- sampling: the target's exact distribution ------------------------------------------------

SAMPLED_CASES = {
    "temperature": SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True),
    "truncated-penalised": SamplingParams(
        temperature=0.8,
        top_k=6,
        top_p=0.95,
        min_p=0.02,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        repetition_penalty=1.3,
        max_tokens=4,
        ignore_eos=True,
    ),
}


def processed_probs(logits: torch.Tensor, seen: list[list[int]], outputs: list[list[int]], p: SamplingParams):
    """The sampling distribution of each row as vLLM defines it, written out plainly: repetition
    penalty over prompt and output tokens, presence and frequency over the outputs, then
    temperature, top-k, top-p, min-p. logits: [rows, vocab]."""
    logits = logits.clone()
    for row, (tokens, outs) in enumerate(zip(seen, outputs)):
        for token in set(tokens):
            value = logits[row, token]
            logits[row, token] = value / p.repetition_penalty if value > 0 else value * p.repetition_penalty
        for token in set(outs):
            logits[row, token] -= p.frequency_penalty * outs.count(token) + p.presence_penalty
    logits = logits / p.temperature
    if p.top_k > 0:
        kth = logits.topk(p.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        outside = cumulative - sorted_logits.softmax(dim=-1) >= p.top_p  # mass before it already >= p
        sorted_logits = sorted_logits.masked_fill(outside, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    if p.min_p > 0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


@torch.no_grad()
def exact_joint(hf_model, prompt: list[int], params: SamplingParams, length: int) -> dict[tuple, float]:
    """P(first ``length`` outputs) under the HF model and ``params``, every sequence enumerated."""
    joint = {(): 1.0}
    for _ in range(length):
        prefixes = list(joint)
        inputs = torch.tensor([prompt + list(prefix) for prefix in prefixes])
        logits = hf_model(inputs).logits[:, -1].float()
        seen = [prompt + list(prefix) for prefix in prefixes]
        probs = processed_probs(logits, seen, [list(prefix) for prefix in prefixes], params)
        joint = {
            (*prefix, token): joint[prefix] * float(probs[i, token])
            for i, prefix in enumerate(prefixes)
            for token in range(probs.shape[1])
            if probs[i, token] > 0
        }
    return joint


def pair_p_value(samples: list[tuple], joint: dict[tuple, float], first: int) -> float:
    """Chi-square p-value of the samples' tokens (first, first + 1) against the exact joint's
    marginal; cells expected below 5 are pooled (a token pair of probability 0 fails at once)."""
    marginal: dict[tuple, float] = {}
    for seq, prob in joint.items():
        key = seq[first : first + 2]
        marginal[key] = marginal.get(key, 0.0) + prob
    counts: dict[tuple, int] = {}
    for seq in samples:
        key = tuple(seq[first : first + 2])
        assert key in marginal, f"drew {key}, of probability 0"
        counts[key] = counts.get(key, 0) + 1
    n = len(samples)
    observed, expected, pooled_obs, pooled_exp = [], [], 0, 0.0
    for key, prob in marginal.items():
        if n * prob < 5:
            pooled_obs += counts.get(key, 0)
            pooled_exp += n * prob
        else:
            observed.append(counts.get(key, 0))
            expected.append(n * prob)
    if pooled_exp > 0:
        observed.append(pooled_obs)
        expected.append(pooled_exp)
    obs, exp = torch.tensor(observed, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64)
    statistic = ((obs - exp) ** 2 / exp).sum()
    return float(
        1 - torch.special.gammainc(torch.tensor((len(obs) - 1) / 2, dtype=torch.float64), statistic / 2)
    )


@pytest.fixture(scope="module")
def tiny_vocab_llama(make_tiny_model_for_module):
    """Eight tokens: every sequence of four outputs can be enumerated, and n-gram drafts from a
    prompt cycling through the vocabulary always find a match."""
    return make_tiny_model_for_module(LlamaConfig, vocab_size=8, num_attention_heads=4, num_key_value_heads=2)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(SAMPLED_CASES))
def test_sampled_outputs_follow_the_target_distribution_with_and_without_ngram(tiny_vocab_llama, case):
    hf_model, model_config = tiny_vocab_llama
    params = SAMPLED_CASES[case]
    prompt = [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 5, 6]
    joint = exact_joint(hf_model, prompt, params, 4)
    num_samples = 3000
    for speculative_config in (None, {"method": "ngram", "num_speculative_tokens": 3}):
        llm = make_llm(model_config, block_size=4, max_num_seqs=256, speculative_config=speculative_config)
        outputs = llm.generate(
            prompt_token_ids=[prompt] * num_samples, sampling_params=params, use_tqdm=False
        )
        samples = [tuple(o.outputs[0].token_ids) for o in outputs]
        for first in range(3):
            assert pair_p_value(samples, joint, first) > 1e-3, (speculative_config, first)
        if speculative_config is not None:
            spec = llm.llm_engine.scheduler.spec_decoding
            # Both acceptance and rejection happened, at the draft positions under test.
            assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens
            assert spec.num_accepted_tokens_per_pos[1] > 0


@pytest.mark.slow
def test_synthetic_acceptance_drafts_every_step_and_accepts_at_its_rate(tiny_llama):
    """Benchmarks only (``bench latency --synthetic-acceptance-rate``): drafts every step, even on
    random prompts, accepted at the given rate whatever the model says."""
    _, model_config = tiny_llama
    prompts = mixed_prompts(6, model_config.vocab_size, seed=6)[1::2]  # the random ones
    params = SamplingParams(temperature=0.0, max_tokens=13, ignore_eos=True)
    for rate in (1.0, 0.0):
        config = {"method": "ngram", "num_speculative_tokens": 3, "synthetic_acceptance_rate": rate}
        llm = make_llm(model_config, block_size=4, speculative_config=config)
        outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 13 for o in outputs)
        spec = llm.llm_engine.scheduler.spec_decoding
        # After the first token every step drafts min(3, 13 - outputs - 1): accepting all, 3 steps
        # of 3 drafts (outputs 1, 5, 9); accepting none, 9 steps of 3 (outputs 1-9), then 2, 1, 0.
        per_request = 9 if rate == 1.0 else 30
        assert spec.num_draft_tokens == per_request * len(prompts)
        assert spec.num_accepted_tokens == (spec.num_draft_tokens if rate == 1.0 else 0)
        assert_all_blocks_free(llm)


def test_the_command_line_takes_the_config_as_json(tiny_llama):
    _, model_config = tiny_llama
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(
        ["--model", model_config.model, "--device", "cpu", "--speculative-config", json.dumps(NGRAM)]
    )
    config = EngineArgs.from_cli_args(args).create_engine_config()
    assert config.speculative_config == SpeculativeConfig(
        num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=1
    )
    assert not config.async_scheduling
