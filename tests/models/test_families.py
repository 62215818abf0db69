"""The breadth families (Phi-3, OLMo-2, SmolLM3, EXAONE-4, GLM-4-MoE) and gpt-oss against Hugging Face
``generate`` (greedy, float32, CPU), through ``LLM`` on every attention backend that runs on the
CPU: torch, cpu and Triton (under the interpreter).

Each family is a tiny random model (head_dim 64, so the Triton kernels take it) whose windows are
shorter than its prompts, built to exercise what the family adds: a partial rotation, post-norms,
a q/k norm over the whole projection, NoPE layers, grouped routing with shared experts, learned
sinks with alternating windows and a clamped SwiGLU. The batch
is ragged (112-160 tokens), the second prompt shares the first's 96-token prefix with prefix
caching on, and prefills are chunked.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from transformers import (
    DeepseekV2Config,
    DeepseekV3Config,
    Exaone4Config,
    Glm4MoeConfig,
    GptOssConfig,
    Olmo2Config,
    Phi3Config,
    SmolLM3Config,
)

from pagedllm import LLM, SamplingParams
from pagedllm.attention.backends.cuda_backend import CudaAttentionBackend
from pagedllm.attention.backends.torch_backend import TorchAttentionBackend
from pagedllm.layers.fused_moe import select_experts_group_limited, select_experts_grouped
from pagedllm.model_loader import get_model
from pagedllm.models import get_model_class
from pagedllm.models.glm4_moe import Glm4MoeForCausalLM
from pagedllm.models.llama import LlamaForCausalLM
from pagedllm.models.olmo2 import Exaone4ForCausalLM, Olmo2ForCausalLM

MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
# Special tokens inside the tiny vocabulary (the families' defaults are real tokenizers' ids).
_BASE = {
    "max_position_embeddings": 512,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

# name: (config class, overrides).
CASES: dict[str, tuple[type, dict[str, Any]]] = {
    # Fused qkv/gate_up checkpoint tensors, 3/4 of each head rotated, a window on every layer.
    "phi3-partial-rotary-window32": (
        Phi3Config,
        {
            **_BASE,
            "sliding_window": 32,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75},
        },
    ),
    # Post-norms, q/k RMSNorm over the whole projections.
    "olmo2": (Olmo2Config, {**_BASE, "num_attention_heads": 4, "num_key_value_heads": 2}),
    # Layer 1 is NoPE and slides (SmolLM3 puts its windows on the NoPE layers).
    "smollm3-nope-window24": (
        SmolLM3Config,
        {**_BASE, "no_rope_layers": [1, 0], "use_sliding_window": True, "sliding_window": 24},
    ),
    # Layer 0 slides and rotates, layer 1 is global and NoPE; per-head q/k norms; post-norms.
    "exaone4-window16": (Exaone4Config, {**_BASE, "sliding_window": 16, "sliding_window_pattern": 2}),
    # Layer 0 dense, 1-2 sparse: 8 experts in 4 groups, 2 groups kept, top-2, one shared expert.
    "glm4moe-grouped": (
        Glm4MoeConfig,
        {
            **_BASE,
            "num_hidden_layers": 3,
            "first_k_dense_replace": 1,
            "moe_intermediate_size": 32,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "n_group": 4,
            "topk_group": 2,
            "n_shared_experts": 1,
            "routed_scaling_factor": 2.5,
            "partial_rotary_factor": 0.5,
            "attention_bias": True,
            "use_qk_norm": True,
        },
    ),
    # Learned sinks, layer 0 in a 16-token window and layer 1 global, YaRN, 4 experts top-2 with
    # biases and a SwiGLU limit small enough to clamp.
    "gptoss-sinks-window16-yarn": (
        GptOssConfig,
        {
            **_BASE,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": 16,
            "layer_types": ["sliding_attention", "full_attention"],
            "swiglu_limit": 0.5,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 4.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 64,
            },
        },
    ),
}

# DeepSeek-V2's multi-head latent attention, on the torch, cpu and Triton backends; with and without
# q_lora, greedy and group-limited routing, YaRN's mscale.
_MLA = {
    **_BASE,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 24,
    "moe_intermediate_size": 32,
    "num_experts_per_tok": 2,
}
MLA_CASES: dict[str, tuple[type, dict[str, Any]]] = {
    "deepseekv2-group-limited": (
        DeepseekV2Config,
        {
            **_MLA,
            "num_hidden_layers": 3,
            "first_k_dense_replace": 1,
            "q_lora_rank": None,
            "n_routed_experts": 8,
            "n_shared_experts": 1,
            "topk_method": "group_limited_greedy",
            "n_group": 4,
            "topk_group": 2,
            "routed_scaling_factor": 1.5,
        },
    ),
    "deepseekv2-q-lora-yarn": (
        DeepseekV2Config,
        {
            **_MLA,
            "q_lora_rank": 24,
            "n_routed_experts": 4,
            "n_shared_experts": 2,
            "topk_method": "greedy",
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "mscale": 0.707,
                "mscale_all_dim": 0.707,
                "beta_fast": 32,
                "beta_slow": 1,
            },
        },
    ),
    # DeepSeek-V3: V2's MLA with noaux_tc routing (sigmoid + bias, 4 groups keep 2, renormalised,
    # scaled), q_lora, one dense layer; rope dims as halves (rope_interleave=False) on one case.
    "deepseekv3-noaux-tc": (
        DeepseekV3Config,
        {
            **_MLA,
            "head_dim": 8,  # V3's rotary takes head_dim as its width: qk_rope_head_dim
            "num_hidden_layers": 3,
            "first_k_dense_replace": 1,
            "q_lora_rank": 24,
            "n_routed_experts": 8,
            "n_shared_experts": 1,
            "n_group": 4,
            "topk_group": 2,
            "norm_topk_prob": True,
            "routed_scaling_factor": 2.5,
        },
    ),
    "deepseekv3-halves-rope": (
        DeepseekV3Config,
        {
            **_MLA,
            "head_dim": 8,  # V3's rotary takes head_dim as its width: qk_rope_head_dim
            "num_hidden_layers": 2,
            "first_k_dense_replace": 1,
            "q_lora_rank": None,
            "n_routed_experts": 4,
            "n_shared_experts": 2,
            "n_group": 2,
            "topk_group": 1,
            "norm_topk_prob": False,
            "routed_scaling_factor": 1.5,
            "rope_interleave": False,
        },
    ),
}
CASES.update(MLA_CASES)

# The Triton interpreter takes ~10-20 s a case.
BACKENDS = ("torch", "cpu", "triton")
# Every family on every backend (MLA on Triton: its own decode kernel, models/mla_paged.py).
GREEDY_CASES = [
    pytest.param(case, backend, marks=[pytest.mark.slow] if backend == "triton" else [])
    for case in CASES
    for backend in BACKENDS
]


@pytest.fixture(scope="module")
def case_model(greedy_reference: Callable) -> Callable[[str], tuple[str, list, list]]:
    def get(case: str) -> tuple[str, list, list]:
        config_class, overrides = CASES[case]
        return greedy_reference(config_class, overrides, MAX_TOKENS, "cpu", list(CASES).index(case))

    return get


# Chunked prompts (48-token steps) and prefix caching, as both greedy tests run every family.
ENGINE_OPTIONS = dict(
    device="cpu",
    max_model_len=512,
    block_size=8,
    enable_chunked_prefill=True,
    max_num_batched_tokens=48,
    max_num_seqs=4,
    enable_prefix_caching=True,
)


@pytest.mark.parametrize("case, backend", GREEDY_CASES)
def test_greedy_equals_hf(case_model: Callable, case: str, backend: str) -> None:
    model, prompts, expected = case_model(case)
    # The Triton interpreter is slow: two prompts (the prefix-sharing pair) are its whole test.
    num_prompts = 2 if backend == "triton" else len(prompts)
    llm = LLM(model, attention_backend=backend, **ENGINE_OPTIONS)
    outputs = llm.generate(prompt_token_ids=prompts[:num_prompts], sampling_params=GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected[:num_prompts]


@pytest.mark.parametrize("case", list(CASES))
def test_two_pipeline_stages_give_hfs_greedy_tokens(case_model: Callable, case: str) -> None:
    """Every family over two pipeline stages (two gloo ranks, micro-batches in flight): HF's
    greedy tokens, with chunked prefill and prefix caching, windows, MLA's latent cache, routers."""
    model, prompts, expected = case_model(case)
    llm = LLM(model, pipeline_parallel_size=2, async_scheduling=True, swap_space=0.01, **ENGINE_OPTIONS)
    try:
        outputs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected
    finally:
        llm.llm_engine.shutdown()


def test_registry_and_layer_choices(make_tiny_model: Callable) -> None:
    assert get_model_class(["Phi3ForCausalLM"]) is LlamaForCausalLM
    assert get_model_class(["SmolLM3ForCausalLM"]) is LlamaForCausalLM
    assert get_model_class([], "olmo2") is Olmo2ForCausalLM
    assert get_model_class(["Exaone4ForCausalLM"]) is Exaone4ForCausalLM
    assert get_model_class(["Glm4MoeForCausalLM"]) is Glm4MoeForCausalLM
    config = Exaone4Config(
        **{**_BASE, "num_hidden_layers": 4, "sliding_window": 16, "sliding_window_pattern": 2}
    )
    # HF's rule: with a window, the sliding layers rotate and the global ones are NoPE.
    assert [Exaone4ForCausalLM.uses_rope(config, i) for i in range(4)] == [True, False, True, False]
    assert [LlamaForCausalLM.uses_rope(SmolLM3Config(num_hidden_layers=4), i) for i in range(4)] == [
        True,
        True,
        True,
        False,
    ]


def test_grouped_router_matches_transformers() -> None:
    """select_experts_grouped against transformers' Glm4MoeTopkRouter on random logits."""
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    config = Glm4MoeConfig(
        hidden_size=16,
        n_routed_experts=16,
        num_experts_per_tok=3,
        n_group=4,
        topk_group=2,
        norm_topk_prob=True,
        routed_scaling_factor=1.7,
    )
    router = Glm4MoeTopkRouter(config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(16, 16, generator=generator))
        router.e_score_correction_bias.copy_(torch.randn(16, generator=generator) * 0.3)
    hidden = torch.randn(64, 16, generator=generator)
    logits, hf_weights, hf_ids = router(hidden)
    weights, ids = select_experts_grouped(logits, 3, 4, 2, router.e_score_correction_bias, True, 1.7)
    # Same experts with the same weights (each side's order within a token is its own).
    hf_order, order = hf_ids.argsort(dim=-1), ids.argsort(dim=-1)
    assert torch.equal(hf_ids.gather(1, hf_order), ids.gather(1, order))
    torch.testing.assert_close(weights.gather(1, order), hf_weights.gather(1, hf_order))


def test_grouped_router_rejects_groups_that_do_not_divide() -> None:
    from pagedllm.models.glm4_moe import GroupedTopkRouter

    with pytest.raises(ValueError, match=r"n_group \(3\) must divide n_routed_experts \(8\)"):
        GroupedTopkRouter(Glm4MoeConfig(hidden_size=16, n_routed_experts=8, n_group=3, topk_group=1))


def test_mla_refuses_other_backends(make_tiny_model: Callable) -> None:
    config_class, overrides = MLA_CASES["deepseekv2-group-limited"]
    _, model_config = make_tiny_model(config_class, **overrides)
    with pytest.raises(
        ValueError, match=r"runs on the attention backends \('torch', 'cpu', 'triton'\), got 'cuda'"
    ):
        get_model(model_config, "auto", torch.device("cpu"), CudaAttentionBackend)


def test_mla_caches_one_latent_per_token(make_tiny_model: Callable) -> None:
    config_class, overrides = MLA_CASES["deepseekv2-group-limited"]
    _, model_config = make_tiny_model(config_class, **overrides)
    assert (model_config.num_kv_heads, model_config.head_size) == (1, 32 + 8)  # kv_lora_rank + rope dims


def test_group_limited_router_matches_transformers() -> None:
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    config = DeepseekV2Config(
        hidden_size=16,
        num_attention_heads=2,
        n_routed_experts=16,
        num_experts_per_tok=3,
        n_group=4,
        topk_group=2,
        topk_method="group_limited_greedy",
        routed_scaling_factor=1.7,
    )
    router = DeepseekV2TopkRouter(config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(16, 16, generator=generator))
    logits, hf_weights, hf_ids = router(torch.randn(64, 16, generator=generator))
    weights, ids = select_experts_group_limited(logits, 3, 4, 2, 1.7)
    hf_order, order = hf_ids.argsort(dim=-1), ids.argsort(dim=-1)
    assert torch.equal(hf_ids.gather(1, hf_order), ids.gather(1, order))
    torch.testing.assert_close(weights.gather(1, order), hf_weights.gather(1, hf_order))


@pytest.mark.parametrize("case", list(MLA_CASES))
def test_mla_logits_match_hf(
    make_tiny_model: Callable, prefill_then_decode_match_hf: Callable, case: str
) -> None:
    """Logits, not only the argmax: a ragged prefill, then a decode reading the latent cache back."""
    config_class, overrides = MLA_CASES[case]
    hf_model, model_config = make_tiny_model(config_class, **overrides)
    model = get_model(model_config, "auto", torch.device("cpu"), TorchAttentionBackend)
    prefill_then_decode_match_hf(hf_model, model_config, model, atol=1e-4)


def test_mla_allocates_one_cache_per_layer(case_model: Callable) -> None:
    """The latent is key and value: each layer's value cache is its key cache, and a block costs
    the latent's bytes once."""
    model, prompts, expected = case_model("deepseekv2-group-limited")
    llm = LLM(model, device="cpu", attention_backend="torch", max_model_len=512, block_size=8)
    worker = llm.llm_engine.executor.worker
    spec = worker.get_kv_cache_spec()
    assert spec.keys_only and spec.block_bytes == 3 * 8 * (32 + 8) * 4  # layers * block * latent * fp32
    key_cache, value_cache = worker.cache_engine.gpu_cache[0]
    assert value_cache is key_cache
    outputs = llm.generate(prompt_token_ids=prompts[:1], sampling_params=GREEDY, use_tqdm=False)
    assert outputs[0].outputs[0].token_ids == expected[0]


def test_deepseek_v3_skips_the_mtp_layer(make_tiny_model: Callable, caplog: pytest.LogCaptureFixture) -> None:
    """A checkpoint's multi-token-prediction layer (index num_hidden_layers) loads as nothing,
    with a notice; a tensor of no layer still fails."""
    from safetensors.torch import load_file, save_file

    from pagedllm.models.deepseek_v3 import DeepseekV3ForCausalLM

    config_class, overrides = MLA_CASES["deepseekv3-noaux-tc"]
    _, model_config = make_tiny_model(config_class, **overrides)
    assert get_model_class([], "deepseek_v3") is DeepseekV3ForCausalLM
    path = f"{model_config.model}/model.safetensors"
    tensors = load_file(path)
    tensors["model.layers.3.eh_proj.weight"] = torch.zeros(4, 4)
    tensors["model.layers.3.enorm.weight"] = torch.zeros(4)
    save_file(tensors, path, metadata={"format": "pt"})
    with caplog.at_level("INFO"):
        get_model(model_config, "auto", torch.device("cpu"), TorchAttentionBackend)
    assert sum("multi-token-prediction" in r.message for r in caplog.records) == 1
    tensors["model.bogus.weight"] = torch.zeros(4)
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.bogus\.weight"):
        get_model(model_config, "auto", torch.device("cpu"), TorchAttentionBackend)


@pytest.mark.parametrize(
    "case, query_len, seq_len",
    [("deepseekv2-group-limited", 1, 1), ("deepseekv2-q-lora-yarn", 1, 37), ("deepseekv3-noaux-tc", 5, 64)],
)
def test_mla_absorbed_equals_expanded(
    make_tiny_model: Callable, case: str, query_len: int, seq_len: int
) -> None:
    """The absorbed form (decode's) against the expanded form (prefill's, the one checked against
    HF) on random queries and latents: float32, ~1e-5."""
    from pagedllm.models.deepseek_v2 import MLAAttention

    config_class, overrides = MLA_CASES[case]
    _, model_config = make_tiny_model(config_class, **overrides)
    model = get_model(model_config, "auto", torch.device("cpu"), TorchAttentionBackend)
    attention = next(m for m in model.modules() if isinstance(m, MLAAttention))
    assert attention._attend_step == attention._step_per_sequence  # the torch backend's path
    generator = torch.Generator().manual_seed(query_len + seq_len)
    query = torch.randn(query_len, attention.num_heads, attention.qk_head_dim, generator=generator)
    context = torch.randn(seq_len, attention.kv_lora_rank + attention.qk_rope_head_dim, generator=generator)
    expected = attention._attend(query, context)
    torch.testing.assert_close(attention._attend_absorbed(query, context), expected, rtol=1e-5, atol=1e-5)
