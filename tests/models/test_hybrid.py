"""Hybrid models end to end: Qwen3-Next (Gated DeltaNet + gated attention, shared-expert MoE),
Qwen3.5 (dense and MoE) and Nemotron-H (Mamba-2 + attention + MLP layers), against Hugging
Face ``generate`` in float32 on the CPU: prompts several prefill chunks long, ragged batches with a
one-token prompt, fewer state slots than requests (slots reused), preemption by recompute (a tiny
KV cache), forks (sampled siblings, beam search, swapped groups) each continuing its parent's
state, prefix caching asked for (disabled with a logged reason), and the refusals."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    NemotronHConfig,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen3NextConfig,
)

from pagedllm import LLM, SamplingParams
from pagedllm.attention.backends.torch_backend import TorchAttentionBackend
from pagedllm.core.scheduler import PreemptionMode
from pagedllm.entrypoints.bench.workloads import WORKLOADS
from pagedllm.layers.linear_attention.gated_deltanet import GatedDeltaNet
from pagedllm.layers.linear_attention.mamba2 import Mamba2Mixer, Mamba2Spec
from pagedllm.layers.linear_attention.state import LayerStateShape, StateCacheSpec
from pagedllm.layers.quantization.params import PER_PROJECTION, set_layout
from pagedllm.models import get_model_class
from pagedllm.models.nemotron_h import NemotronHBlock, NemotronHForCausalLM
from pagedllm.models.qwen3_next import Qwen3NextForCausalLM
from pagedllm.worker.state_cache import kv_budget_after_state
from tests.conftest import hf_greedy
from tests.engine.test_sampling_features import hf_beam_search

MAX_TOKENS = 10
# A ragged batch, then two prompts for the preemption test.
PROMPT_LENS = (70, 1, 33, 150, 30, 31)
# Layers: linear, linear, linear, full (the default 3:1 pattern); MoE everywhere but layer 1.
TINY_QWEN3_NEXT = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
    mlp_only_layers=[1],
    tie_word_embeddings=False,
)


# Qwen3.5's text models: the Gated DeltaNet's projections kept apart; dense, or MoE on every layer.
_QWEN3_5_COMMON = {
    key: value
    for key, value in TINY_QWEN3_NEXT.items()
    if key not in ("intermediate_size", "num_experts", "num_experts_per_tok", "moe_intermediate_size")
    and key not in ("shared_expert_intermediate_size", "mlp_only_layers")
}
QWEN3_5_CASES = {
    "qwen3.5-dense": lambda: Qwen3_5TextConfig(intermediate_size=96, **_QWEN3_5_COMMON),
    "qwen3.5-moe": lambda: Qwen3_5MoeTextConfig(
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        **_QWEN3_5_COMMON,
    ),
}


# Nemotron-H: Mamba-2, MLP, attention (no positions), Mamba-2, MLP; 8 heads of 8 in 2 groups.
TINY_NEMOTRON_H = dict(
    vocab_size=160,
    hidden_size=64,
    num_hidden_layers=5,
    layers_block_type=["linear_attention", "mlp", "full_attention", "linear_attention", "mlp"],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    mamba_num_heads=8,
    mamba_head_dim=8,
    n_groups=2,
    ssm_state_size=16,
    intermediate_size=96,
    chunk_size=16,
    max_position_embeddings=512,
)


@pytest.fixture(scope="module")
def nemotron_h(make_hybrid_reference: Callable) -> tuple[str, list[list[int]], list[list[int]]]:
    return make_hybrid_reference(NemotronHConfig(**TINY_NEMOTRON_H), PROMPT_LENS, MAX_TOKENS)


@pytest.fixture(scope="module")
def qwen3_next(make_hybrid_reference: Callable) -> tuple[str, list[list[int]], list[list[int]]]:
    """(model directory, ragged prompts, HF's greedy continuations)."""
    config = Qwen3NextConfig(**TINY_QWEN3_NEXT)
    assert config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    return make_hybrid_reference(config, PROMPT_LENS, MAX_TOKENS)


def _generate(path: str, prompts: list[list[int]], **kwargs) -> tuple[LLM, list[list[int]]]:
    llm = LLM(
        path,
        device="cpu",
        dtype="float32",
        enable_chunked_prefill=True,
        max_num_batched_tokens=32,  # prompts of up to 150 tokens: five chunks
        **kwargs,
    )
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return llm, [list(o.outputs[0].token_ids) for o in outputs]


def _assert_state_slots_free(llm: LLM) -> None:
    pool = llm.llm_engine.engine_core.scheduler.kv_cache_manager.state_pool
    assert pool is not None and pool.get_num_free_slots() == pool.num_slots


@pytest.mark.slow
def test_greedy_matches_hf_over_chunked_prefills_and_a_ragged_batch(qwen3_next) -> None:
    path, prompts, expected = qwen3_next
    llm, outputs = _generate(path, prompts[:4], max_num_seqs=4)
    assert outputs == expected[:4]
    _assert_state_slots_free(llm)


@pytest.mark.slow
def test_nemotron_h_greedy_matches_hf_over_chunked_prefills_and_a_ragged_batch(nemotron_h) -> None:
    path, prompts, expected = nemotron_h
    llm, outputs = _generate(path, prompts[:4], max_num_seqs=4)
    assert outputs == expected[:4]
    _assert_state_slots_free(llm)


@pytest.mark.slow
def test_nemotron_h_greedy_matches_hf_through_preemption_and_slot_reuse(nemotron_h) -> None:
    path, prompts, expected = nemotron_h
    llm, outputs = _generate(
        path, prompts[4:], max_num_seqs=2, block_size=4, num_kv_blocks=18, max_model_len=64
    )
    assert outputs == expected[4:]
    assert llm.llm_engine.engine_core.scheduler.num_preemptions[PreemptionMode.RECOMPUTE] >= 1
    _assert_state_slots_free(llm)


def num_state_layers(worker) -> int:
    return len(worker.state_cache_spec.layer_shapes)


@pytest.mark.parametrize("family", ["qwen3_next", "nemotron_h"])
def test_two_pipeline_stages_match_hf(family: str, request: pytest.FixtureRequest) -> None:
    """Each stage keeps the recurrent state of its own linear-attention layers and the KV of its
    attention layers: HF's greedy tokens over chunked prefills, micro-batches in flight."""
    path, prompts, expected = request.getfixturevalue(family)
    llm, outputs = _generate(
        path, prompts[:4], max_num_seqs=4, pipeline_parallel_size=2, async_scheduling=True
    )
    try:
        assert outputs == expected[:4]
        hf_config = llm.llm_engine.config.model_config.hf_config
        kinds = getattr(hf_config, "layers_block_type", None) or hf_config.layer_types
        half = -(-len(kinds) // 2)  # the first stage takes the odd layer
        stages = (kinds[:half], kinds[half:])
        executor = llm.llm_engine.executor
        kv_layers = [spec.num_layers for spec in executor.collective_rpc("get_kv_cache_spec")]
        assert kv_layers == [stage.count("full_attention") for stage in stages]
        assert executor.collective_rpc(num_state_layers) == [
            stage.count("linear_attention") for stage in stages
        ]
    finally:
        llm.llm_engine.shutdown()


def state_shapes_of_rank(worker) -> list:
    return list(worker.state_cache_spec.layer_shapes)


def assert_each_of_two_ranks_keeps_its_part_of_the_state(llm: LLM) -> None:
    hf_config = llm.llm_engine.config.model_config.hf_config
    model_class = get_model_class(hf_config.architectures, hf_config.model_type)
    half = model_class.state_shapes(hf_config, 2)
    assert half != model_class.state_shapes(hf_config, 1)
    assert llm.llm_engine.executor.collective_rpc(state_shapes_of_rank) == [half, half]


@pytest.mark.parametrize("family", ["qwen3_next", "nemotron_h"])
def test_two_tensor_parallel_ranks_match_hf(family: str, request: pytest.FixtureRequest) -> None:
    """Each rank keeps its heads' part of every linear layer's state (Gated DeltaNet's key heads
    and their value heads; Mamba-2's heads and groups of B and C): HF's greedy tokens."""
    path, prompts, expected = request.getfixturevalue(family)
    llm, outputs = _generate(path, prompts[:4], max_num_seqs=4, tensor_parallel_size=2)
    try:
        assert outputs == expected[:4]
        assert_each_of_two_ranks_keeps_its_part_of_the_state(llm)
    finally:
        llm.llm_engine.shutdown()


def test_mamba_group_counts_the_ranks_cannot_split_are_refused() -> None:
    config = NemotronHConfig(**TINY_NEMOTRON_H)  # 2 groups
    with pytest.raises(ValueError, match=r"n_groups \(2\) must be divisible by tensor_parallel_size \(4\)"):
        NemotronHForCausalLM.state_shapes(config, 4)


def test_nemotron_h_moe_layers_are_refused() -> None:
    config = NemotronHConfig(**{**TINY_NEMOTRON_H, "layers_block_type": ["linear_attention", "moe"]})
    with pytest.raises(ValueError, match="layers_block_type 'moe'"):
        NemotronHBlock(config, 1, TorchAttentionBackend)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(QWEN3_5_CASES))
def test_qwen3_5_greedy_matches_hf(case: str, make_hybrid_reference: Callable) -> None:
    path, prompts, expected = make_hybrid_reference(QWEN3_5_CASES[case](), PROMPT_LENS[:3], MAX_TOKENS)
    llm, outputs = _generate(path, prompts, max_num_seqs=4)
    assert outputs == expected
    _assert_state_slots_free(llm)


@pytest.mark.slow
def test_greedy_matches_hf_with_fewer_state_slots_than_requests(qwen3_next) -> None:
    """Two slots for four requests: requests join while others decode (different positions in
    one step) and take slots others freed, whose stale state they must not read."""
    path, prompts, expected = qwen3_next
    llm, outputs = _generate(path, prompts[:4], max_num_seqs=2)
    assert outputs == expected[:4]
    assert llm.llm_engine.engine_core.scheduler.kv_cache_manager.state_pool.num_slots == 2
    _assert_state_slots_free(llm)


@pytest.mark.slow
def test_greedy_matches_hf_through_preemption_by_recompute(qwen3_next) -> None:
    """Two prompts of 8 blocks of 4 each in a cache of 18: both start, both grow, one is
    preempted, freeing its state slot, and recomputed from position 0 (its state from zeros)."""
    path, prompts, expected = qwen3_next
    llm, outputs = _generate(
        path, prompts[4:], max_num_seqs=2, block_size=4, num_kv_blocks=18, max_model_len=64
    )
    assert outputs == expected[4:]
    assert llm.llm_engine.engine_core.scheduler.num_preemptions[PreemptionMode.RECOMPUTE] >= 1
    _assert_state_slots_free(llm)


@pytest.mark.slow
def test_prefix_caching_is_disabled_with_a_logged_reason(qwen3_next, caplog) -> None:
    path, prompts, expected = qwen3_next
    shared = [prompts[3][:100] + prompts[0][:20], prompts[3]]  # a 100-token common prefix
    with caplog.at_level(logging.INFO, logger="pagedllm.core.kv_cache_manager"):
        llm, outputs = _generate(path, shared, max_num_seqs=2, enable_prefix_caching=True)
    assert "prefix caching disabled" in caplog.text
    assert not llm.llm_engine.engine_core.scheduler.kv_cache_manager.enable_prefix_caching
    assert outputs[1] == expected[3]


def test_an_all_attention_config_of_a_hybrid_family_keeps_prefix_caching(make_hybrid_reference) -> None:
    """Qwen3-Next's architecture with every layer full attention (``benchmarks/configs/``'s
    all-attention twin of W6): no recurrent state, so nothing disables prefix caching, and the
    second prompt reads the first's cached blocks."""
    config = Qwen3NextConfig(**{**TINY_QWEN3_NEXT, "layer_types": ["full_attention"] * 4})
    path, prompts, _ = make_hybrid_reference(config, (100, 20), MAX_TOKENS)
    shared = [prompts[0], prompts[0][:96] + prompts[1]]  # 6 blocks of 16 in common
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    expected = hf_greedy(hf_model, shared, MAX_TOKENS, "cpu")
    llm, outputs = _generate(path, shared, max_num_seqs=1, enable_prefix_caching=True)
    kv_cache_manager = llm.llm_engine.engine_core.scheduler.kv_cache_manager
    assert kv_cache_manager.enable_prefix_caching and kv_cache_manager.state_pool is None
    assert kv_cache_manager.get_prefix_cache_hit_rate() > 0
    assert outputs == expected


def assert_logprobs_match_hf(path: str, prompts: list[list[int]], outputs: list) -> None:
    """Every sequence's sampled tokens scored by HF's model over the whole text (teacher forcing):
    a fork that started from any state but its parent's after the prompt would score otherwise."""
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for prompt, output in zip(prompts, outputs):
        for completion in output.outputs:
            full = prompt + list(completion.token_ids)
            with torch.no_grad():
                reference = torch.log_softmax(hf_model(torch.tensor([full])).logits[0].float(), dim=-1)
            assert len(completion.logprobs) == len(completion.token_ids)
            for step, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
                assert abs(entry[token].logprob - reference[len(prompt) - 1 + step, token].item()) < 1e-4


@pytest.mark.parametrize("family", ["qwen3_next", "nemotron_h"])
def test_sampled_siblings_each_continue_the_prompts_state(
    family: str, request: pytest.FixtureRequest
) -> None:
    """n = 3 siblings forked after a prompt of several prefill chunks (a ragged pair): each takes
    a slot holding a copy of its parent's state (conv window and recurrent state), and HF scores
    each one's tokens as the engine did."""
    path, prompts, _ = request.getfixturevalue(family)
    chunked = dict(enable_chunked_prefill=True, max_num_batched_tokens=32, max_num_seqs=8)
    llm = LLM(path, device="cpu", dtype="float32", **chunked)
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=MAX_TOKENS, logprobs=0, ignore_eos=True)
    pair = [prompts[0], prompts[2]]
    outputs = llm.generate(prompt_token_ids=pair, sampling_params=params, use_tqdm=False)
    for output in outputs:
        assert len({tuple(c.token_ids) for c in output.outputs}) == 3  # three different paths
    assert_logprobs_match_hf(path, pair, outputs)
    _assert_state_slots_free(llm)


@pytest.mark.slow
def test_beam_search_equals_hf(qwen3_next) -> None:
    """Beams fork and end every step: each fork copies its beam's state before either goes on."""
    path, prompts, _ = qwen3_next
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    eos = hf_model.config.eos_token_id
    # As many seats (and state slots) as one request's beams: a step that ends one beam and forks
    # another must free the first before the fork takes its slot.
    llm = LLM(path, device="cpu", dtype="float32", block_size=4, max_num_seqs=3)
    params = SamplingParams(n=2, best_of=3, use_beam_search=True, temperature=0.0, max_tokens=MAX_TOKENS)
    outputs = llm.generate(prompt_token_ids=prompts[:3], sampling_params=params, use_tqdm=False)
    for prompt, output in zip(prompts[:3], outputs):
        expected = hf_beam_search(hf_model, prompt, 3, 2, MAX_TOKENS, 1.0, False, eos)
        assert [c.token_ids for c in output.outputs] == expected
    _assert_state_slots_free(llm)


def test_forked_siblings_survive_preemption_by_swap(qwen3_next) -> None:
    """Forked groups are preempted by swap: their KV blocks go to the CPU and back while their
    state stays in its slots; every sampled sibling still scores as HF scores it."""
    path, prompts, _ = qwen3_next
    llm = LLM(
        path,
        device="cpu",
        dtype="float32",
        block_size=4,
        num_kv_blocks=24,
        max_model_len=64,
        swap_space=0.01,
        max_num_seqs=4,
    )
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=24, logprobs=0, ignore_eos=True)
    pair = [prompts[4], prompts[5]]  # 30 and 31 tokens: two groups of two outgrow 24 blocks
    outputs = llm.generate(prompt_token_ids=pair, sampling_params=params, use_tqdm=False)
    assert llm.llm_engine.engine_core.scheduler.num_preemptions[PreemptionMode.SWAP] >= 1
    assert_logprobs_match_hf(path, pair, outputs)
    _assert_state_slots_free(llm)


def test_speculative_decoding_is_refused(qwen3_next) -> None:
    ngram = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2, "prompt_lookup_min": 1}
    with pytest.raises(ValueError, match="speculative_config is not supported"):
        LLM(qwen3_next[0], device="cpu", async_scheduling=False, speculative_config=ngram)


@pytest.mark.parametrize("tp_size", [3, 4])
def test_head_counts_the_ranks_cannot_split_are_refused(tp_size: int) -> None:
    config = Qwen3NextConfig(**TINY_QWEN3_NEXT)  # 2 key heads
    with pytest.raises(ValueError, match=r"linear_num_key_heads .* tensor_parallel_size"):
        GatedDeltaNet.state_shape_of(config, tp_size)


def test_qwen3_next_moe_block_adds_its_shared_expert_as_hugging_face_does() -> None:
    """The experts add the shared term now (fused on CUDA); on the CPU it is still HF's
    ``routed + sigmoid(gate(x)) * shared(x)`` in the model dtype, to the bit, and the block is
    HF's block."""
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock as HfBlock

    from pagedllm.models.qwen3_next import Qwen3NextSparseMoeBlock

    config = Qwen3NextConfig(**TINY_QWEN3_NEXT)
    gen = torch.Generator().manual_seed(0)
    block = Qwen3NextSparseMoeBlock(config)
    for param in block.parameters():
        param.data.copy_(torch.randn(param.shape, generator=gen) / param.shape[-1] ** 0.5)
    x = torch.randn(13, config.hidden_size, generator=gen)
    hf = HfBlock(config).eval()
    i = config.shared_expert_intermediate_size
    with torch.no_grad():
        hf.gate.weight.copy_(block.gate.weight)
        hf.experts.gate_up_proj.copy_(block.experts.gate_up_proj)
        hf.experts.down_proj.copy_(block.experts.down_proj)
        hf.shared_expert.gate_proj.weight.copy_(block.shared_expert.gate_up_proj.weight[:i])
        hf.shared_expert.up_proj.weight.copy_(block.shared_expert.gate_up_proj.weight[i:])
        hf.shared_expert.down_proj.weight.copy_(block.shared_expert.down_proj.weight)
        hf.shared_expert_gate.weight.copy_(block.shared_expert_gate.weight)
        torch.testing.assert_close(block(x), hf(x[None])[0], atol=1e-6, rtol=1e-5)
        block.to(torch.bfloat16)
        x = x.to(torch.bfloat16)
        gate = torch.sigmoid(block.shared_expert_gate(x))
        before = block.experts(x, block.gate(x)) + gate * block.shared_expert(x)
        assert torch.equal(block(x), before)


def test_state_per_request_is_constant_in_the_context_length() -> None:
    """What a request keeps per linear layer is its conv window and one d_k x d_v state per head,
    whatever max_model_len: (2 x 2 x 8 + 4 x 8) conv channels x 3, and 4 x 8 x 8."""
    config = Qwen3NextConfig(**TINY_QWEN3_NEXT)
    for max_len in (512, 32768):
        config.max_position_embeddings = max_len
        assert GatedDeltaNet.state_shape_of(config, 1) == LayerStateShape((64, 3), (4, 8, 8))


def test_w6_config_is_a_hybrid_with_constant_state_per_request() -> None:
    """benchmarks/README.md's figures for W6: 18 linear and 6 attention layers, 19.8 MB of bf16
    state per request."""
    config = AutoConfig.from_pretrained(WORKLOADS["W6"].model)
    assert Qwen3NextForCausalLM.num_attention_layers(config) == 6
    shapes = tuple(Qwen3NextForCausalLM.state_shapes(config, 1))
    spec = StateCacheSpec(shapes, torch.bfloat16, torch.bfloat16, 256)
    assert len(spec.layer_shapes) == 18 and spec.slot_bytes == 18 * (8192 * 3 + 32 * 128 * 128) * 2


def test_state_cache_comes_out_of_the_kv_budget() -> None:
    spec = StateCacheSpec(
        (LayerStateShape((48, 3), (4, 8, 8)),) * 3, torch.float32, torch.float32, num_slots=4
    )
    assert spec.slot_bytes == 3 * (48 * 3 + 4 * 8 * 8) * 4
    mixed = StateCacheSpec(spec.layer_shapes, torch.bfloat16, torch.float32, num_slots=4)
    assert mixed.slot_bytes == 3 * (48 * 3 * 2 + 4 * 8 * 8 * 4)
    assert kv_budget_after_state(10**6, spec) == 10**6 - 5 * spec.slot_bytes  # 4 slots + scratch
    with pytest.raises(ValueError, match="lower max_num_seqs or give the cache more memory"):
        kv_budget_after_state(spec.slot_bytes, spec)


def test_mamba_projection_loader_splits_parts_and_keeps_a_per_tensor_scale_whole() -> None:
    """One rank of one: the in_proj's parts load in place; a quantized projection's per-tensor
    scale (one value, not one per row) loads whole rather than split by part."""
    mixer = Mamba2Mixer(Mamba2Spec.from_nemotron_h(NemotronHConfig(**TINY_NEMOTRON_H)))
    weight = mixer.in_proj.weight
    checkpoint = torch.randn(weight.shape)
    weight.weight_loader(weight, checkpoint)
    assert torch.equal(weight.data, checkpoint)
    # As FP8's per-tensor scheme makes it (layers/quantization/fp8.py): one value per projection.
    scale = set_layout(torch.nn.Parameter(torch.empty(1), requires_grad=False), PER_PROJECTION)
    weight.weight_loader(scale, torch.tensor(0.5))
    assert scale.item() == 0.5


_BF16_WINDOWS_F32_STATES = {"mamba_cache_dtype": "bfloat16", "mamba_ssm_cache_dtype": "float32"}


@pytest.mark.parametrize(
    ("family", "args", "conv_dtype", "ssm_dtype"),
    [
        ("qwen3_next", {}, torch.float32, torch.float32),  # auto: the model's
        ("qwen3_next", {"mamba_ssm_cache_dtype": "bfloat16"}, torch.float32, torch.bfloat16),
        ("qwen3_next", {"mamba_cache_dtype": "bfloat16"}, torch.bfloat16, torch.bfloat16),  # both
        ("qwen3_next", _BF16_WINDOWS_F32_STATES, torch.bfloat16, torch.float32),
        ("nemotron_h", _BF16_WINDOWS_F32_STATES, torch.bfloat16, torch.float32),
    ],
)
def test_state_cache_dtypes_as_vllm_names_them(
    family: str, args: dict, conv_dtype, ssm_dtype, request: pytest.FixtureRequest
) -> None:
    """vLLM's mamba_cache_dtype and mamba_ssm_cache_dtype: the tensors bound into the layers are
    allocated in them, and the model still continues HF's greedy tokens (a tiny model: bfloat16
    windows and states round, so only the first tokens are compared)."""
    path, prompts, expected = request.getfixturevalue(family)
    llm, outputs = _generate(path, prompts[:4], max_num_seqs=4, **args)
    for conv_state, ssm_state in llm.llm_engine.executor.worker.state_cache.layers:
        assert (conv_state.dtype, ssm_state.dtype) == (conv_dtype, ssm_dtype)
    exact = conv_dtype == ssm_dtype == torch.float32
    for output, reference in zip(outputs, expected[:4]):
        assert output == reference if exact else output[:2] == reference[:2]


@pytest.mark.parametrize("field", ["mamba_cache_dtype", "mamba_ssm_cache_dtype"])
def test_state_dtypes_the_kernels_cannot_hold_are_refused(qwen3_next, field: str) -> None:
    with pytest.raises(ValueError, match=f"{field} must be one of"):
        LLM(qwen3_next[0], device="cpu", **{field: "fp8"})
