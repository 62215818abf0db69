"""Speculative decoding with EAGLE heads on a GPU, float32: the heads' drafts are those of the
independent reference (tests/engine/test_spec_eagle.py) with CUDA graphs on (the target's hidden
states reach the head through the hooks a graph replays) and off; greedy output is HF's, also
through prefix caching, chunked prefill and preemption; the Llama-3.1-8B-shaped EAGLE-3 head of
``pagedllm bench latency`` loads with dummy weights beside the dummy target."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from test_engine_gpu import hf_greedy, prompts_for
from transformers import LlamaConfig

sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))
from test_spec_eagle import record_proposals, reference_drafts, write_head

from pagedllm import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
CONFIGS = Path(__file__).parents[2] / "benchmarks" / "configs"


# One head of 64 in the heads too (the target's hidden size): the GPU kernels take head sizes from 64.
HEAD_ON_GPU = {"num_attention_heads": 1, "num_key_value_heads": 1}


@pytest.fixture
def target(make_tiny_model):
    """Head size 64 for every kernel; four layers for EAGLE-3's default layers (2, 2, 1)."""
    return make_tiny_model(
        LlamaConfig, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64
    )


@pytest.mark.parametrize("enforce_eager", [True, False])
@pytest.mark.parametrize(
    "method, draft_vocab, aux",
    # The full-vocabulary head shares the target's embeddings and reads layer 0's input, whose
    # capture hook the head's own embedding runs too.
    [("eagle3", 96, None), ("eagle3", None, [0, 2, 3]), ("eagle", None, None)],
)
def test_eagle_drafts_equal_the_reference_and_greedy_equals_hf_on_the_gpu(
    target, tmp_path, enforce_eager, method, draft_vocab, aux
):
    hf_model, model_config = target
    extra = {} if aux is None else {"eagle_aux_hidden_state_layer_ids": aux}
    path, tensors, config = write_head(
        tmp_path / "head", model_config.hf_config, method, draft_vocab, **HEAD_ON_GPU, **extra
    )
    prompts = prompts_for(model_config.vocab_size, 12, seed=0)
    llm = LLM(
        model_config.model,
        device="cuda",
        dtype="float32",
        enforce_eager=enforce_eager,
        num_kv_blocks=512,
        speculative_config={"method": method, "model": path, "num_speculative_tokens": 3},
    )
    calls = record_proposals(llm)
    drafter = llm.llm_engine.executor.worker.model_runner.drafter
    replays = []
    if not enforce_eager:  # the head's pass over decode/verify steps replays its graph
        replay = drafter.pass_graphs.replay
        drafter.pass_graphs.replay = lambda num_tokens: replays.append(num_tokens) or replay(num_tokens)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(hf_model, prompts, GREEDY.max_tokens)
    assert enforce_eager or replays
    contexts = {o.request_id: prompts[i] + o.outputs[0].token_ids for i, o in enumerate(outputs)}
    hf_cpu = hf_model.cpu()
    matches = total = 0
    for step in calls[:8]:
        for req_id, (length, drafts) in step.items():
            context = contexts[str(req_id)][:length]
            reference = reference_drafts(hf_cpu, method, tensors, config, context, 3, aux or [2, 2, 1])
            matches += drafts == reference
            total += 1
    # TF32-free float32 on the GPU against the CPU: a near-tie may flip one argmax, no more.
    assert total > 0 and matches >= total - 1
    assert llm.llm_engine.scheduler.spec_decoding.num_draft_tokens > 0


def test_an_eagle3_head_changes_no_output_through_preemption_prefix_caching_and_chunks_on_the_gpu(
    target, tmp_path
):
    hf_model, model_config = target
    path, _, _ = write_head(tmp_path / "head", model_config.hf_config, "eagle3", 96, **HEAD_ON_GPU)
    shared = prompts_for(model_config.vocab_size, 1, seed=1, lo=20, hi=20)[0]
    prompts = [shared + p for p in prompts_for(model_config.vocab_size, 12, seed=2)]
    llm = LLM(
        model_config.model,
        device="cuda",
        dtype="float32",
        block_size=16,
        # 8 blocks, one request's most: two of these requests fill it (as the draft model's test).
        num_kv_blocks=8,
        max_model_len=128,
        enable_prefix_caching=True,
        enable_chunked_prefill=True,
        max_num_batched_tokens=48,
        max_num_seqs=16,
        speculative_config={"method": "eagle3", "model": path, "num_speculative_tokens": 4},
    )
    expected = hf_greedy(hf_model, prompts, GREEDY.max_tokens)
    for _ in range(2):
        outputs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected
    stats = llm.llm_engine.get_stats()
    assert stats.num_preemptions_recompute > 0 and stats.prefix_cache_hit_rate > 0


def test_the_llama_8b_shaped_eagle3_head_runs_on_dummy_weights():
    """What ``pagedllm bench latency --load-format dummy --speculative-config '{"method":
    "eagle3", "model": "benchmarks/configs/llama-3.1-8b-eagle3", ...}'`` builds."""
    llm = LLM(
        str(CONFIGS / "llama-3.1-8b"),
        device="cuda",
        load_format="dummy",
        skip_tokenizer_init=True,
        max_model_len=2048,
        speculative_config={
            "method": "eagle3",
            "model": str(CONFIGS / "llama-3.1-8b-eagle3"),
            "num_speculative_tokens": 3,
            "synthetic_acceptance_rate": 1.0,
        },
    )
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outputs = llm.generate(prompt_token_ids=[[1, 2, 3, 4]], sampling_params=params, use_tqdm=False)
    assert len(outputs[0].outputs[0].token_ids) == 32
    spec = llm.llm_engine.scheduler.spec_decoding
    assert spec.num_accepted_tokens == spec.num_draft_tokens > 0  # synthetic: every draft accepted
