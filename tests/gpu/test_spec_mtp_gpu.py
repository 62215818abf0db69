"""Speculative decoding's ``"mtp"`` method on a GPU, float32: a DeepSeek-V3-shaped tiny target
(V2-Lite's attention dims, which the Triton MLA decode kernel takes: 16 heads over a 512 + 64
latent; noaux_tc routing) with its multi-token-prediction layer. With CUDA graphs on (the layer's
pass and proposal loop replayed) and off, its drafts are those of the independent reference
(tests/engine/test_spec_mtp.py) and greedy output is HF's."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest
import torch
from test_engine_gpu import hf_greedy, prompts_for
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))
from test_spec_eagle import record_proposals
from test_spec_mtp import SPEC, reference_drafts, write_target_with_mtp

from pagedllm import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
V3_TINY = {
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "q_lora_rank": 64,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "head_dim": 64,  # V3's rotary takes head_dim as its width: qk_rope_head_dim
    "v_head_dim": 128,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "n_group": 4,
    "topk_group": 2,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "max_position_embeddings": 1024,
    "num_nextn_predict_layers": 1,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


@pytest.mark.parametrize("enforce_eager", [True, False])
def test_mtp_drafts_equal_the_reference_and_greedy_equals_hf_on_the_gpu(make_tiny_model, enforce_eager):
    hf_target, directory, block, head = write_target_with_mtp(make_tiny_model, DeepseekV3Config, V3_TINY)
    prompts = prompts_for(V3_TINY["vocab_size"], 8, seed=0)
    llm = LLM(
        directory,
        device="cuda",
        dtype="float32",
        enforce_eager=enforce_eager,
        max_model_len=512,
        gpu_memory_utilization=0.3,  # the previous engine's cache may not be returned yet
        speculative_config=SPEC,
    )
    try:
        calls = record_proposals(llm)
        drafter = llm.llm_engine.executor.worker.model_runner.drafter
        replays = []
        if not enforce_eager:  # the layer's pass over decode/verify steps replays its graph
            replay = drafter.pass_graphs.replay
            drafter.pass_graphs.replay = lambda num_tokens: replays.append(num_tokens) or replay(num_tokens)
        outputs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
        tokens = [o.outputs[0].token_ids for o in outputs]
        assert enforce_eager or replays
        assert llm.llm_engine.scheduler.spec_decoding.num_draft_tokens > 0
    finally:
        llm.llm_engine.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    hf_cpu = hf_target.cpu()
    assert tokens == hf_greedy(hf_cpu, prompts, GREEDY.max_tokens, "cpu")
    contexts = {o.request_id: prompts[i] + o.outputs[0].token_ids for i, o in enumerate(outputs)}
    matches = total = 0
    for step in calls[:8]:
        for req_id, (length, drafts) in step.items():
            reference = reference_drafts(
                hf_cpu, block, head, DeepseekV3RotaryEmbedding, contexts[str(req_id)][:length], 3
            )
            matches += drafts == reference
            total += 1
    # TF32-free float32 on the GPU against the CPU: a near-tie may flip one argmax, no more.
    assert total > 0 and matches >= total - 1
