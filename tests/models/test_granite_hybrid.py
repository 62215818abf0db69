"""IBM Granite 4.0-H (GraniteMoeHybrid: Mamba-2 and attention layers, routed experts plus a
shared MLP, Granite's embedding, residual, attention and logits scalings) and Bamba against
Hugging Face ``generate`` in float32 on the CPU: a ragged batch over chunked prefills, with and without rotary
positions and experts, under two tensor-parallel ranks, and the refusals."""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Callable

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, BambaConfig, GraniteMoeHybridConfig

from pagedllm import LLM, SamplingParams
from pagedllm.models import get_model_class
from pagedllm.models.granitemoehybrid import BambaForCausalLM, GraniteMoeHybridForCausalLM
from tests.models.test_hybrid import (
    assert_each_of_two_ranks_keeps_its_part_of_the_state,
    assert_logprobs_match_hf,
)

MAX_TOKENS = 10
PROMPT_LENS = (70, 1, 33, 150)
# Mamba-2, attention (no positions), Mamba-2, Mamba-2; 8 heads of 16 in 2 groups; 4 experts of
# 32, top-2, and a shared MLP of 48; every scaling away from 1.
TINY_GRANITE = dict(
    vocab_size=160,
    hidden_size=64,
    num_hidden_layers=4,
    layer_types=["mamba", "attention", "mamba", "mamba"],
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=32,
    shared_intermediate_size=48,
    num_local_experts=4,
    num_experts_per_tok=2,
    mamba_n_heads=8,
    mamba_d_head=16,
    mamba_n_groups=2,
    mamba_d_state=16,
    mamba_expand=2,
    mamba_chunk_size=16,
    max_position_embeddings=512,
    embedding_multiplier=1.5,
    residual_multiplier=0.8,
    attention_multiplier=0.3,
    logits_scaling=0.5,
)
# Bamba: Granite 4.0-H's forerunner, its own names (``feed_forward``, ``pre_ff_layernorm``,
# ``final_layernorm``), rotary on half of each head, no scalings.
TINY_BAMBA = {
    key: value
    for key, value in TINY_GRANITE.items()
    if key.startswith("mamba_")
    or key in ("vocab_size", "hidden_size", "num_hidden_layers")
    or key in ("num_attention_heads", "num_key_value_heads", "max_position_embeddings")
}
CASES = {
    "moe-nope": lambda: GraniteMoeHybridConfig(**TINY_GRANITE),
    # Rotary attention, no experts (the shared MLP alone: the dense Granite-4.0-H's).
    "dense-rope": lambda: GraniteMoeHybridConfig(
        **{**TINY_GRANITE, "position_embedding_type": "rope", "num_local_experts": 0}
    ),
    "bamba": lambda: BambaConfig(**TINY_BAMBA, attn_layer_indices=[1], intermediate_size=96),
}


def _generate(path: str, prompts: list[list[int]], **kwargs) -> tuple[LLM, list]:
    llm = LLM(
        path,
        device="cpu",
        dtype="float32",
        enable_chunked_prefill=True,
        max_num_batched_tokens=32,  # prompts of up to 150 tokens: five chunks
        max_num_seqs=4,
        **kwargs,
    )
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0, ignore_eos=True)
    return llm, llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)


def _tokens(outputs: list) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module")
def reference(make_hybrid_reference: Callable) -> Callable[[str], tuple]:
    """reference(case) -> (model directory, prompts, HF's greedy tokens), made once per case."""
    made: dict[str, tuple] = {}

    def make(case: str) -> tuple:
        if case not in made:
            config = CASES[case]()
            assert config.layer_types == ["linear_attention", "full_attention"] + ["linear_attention"] * 2
            made[case] = make_hybrid_reference(config, PROMPT_LENS, MAX_TOKENS)
        return made[case]

    return make


@pytest.fixture(params=list(CASES))
def granite(request: pytest.FixtureRequest, reference: Callable) -> tuple:
    return reference(request.param)


def test_greedy_matches_hf_over_chunked_prefills_and_a_ragged_batch(granite) -> None:
    """The tokens, and their logprobs as HF scores them (greedy alone would not see the logits'
    scaling, nor small errors)."""
    path, prompts, expected = granite
    llm, outputs = _generate(path, prompts)
    assert _tokens(outputs) == expected
    assert_logprobs_match_hf(path, prompts, outputs)
    pool = llm.llm_engine.engine_core.scheduler.kv_cache_manager.state_pool
    assert pool is not None and pool.get_num_free_slots() == pool.num_slots


@pytest.mark.slow  # two engine processes a case; Nemotron-H's always-run test splits the same mixer
def test_two_tensor_parallel_ranks_match_hf(granite) -> None:
    """Each rank keeps its Mamba-2 heads' and groups' part of the state, its experts' slice of
    every expert's width and its KV heads: HF's greedy tokens."""
    path, prompts, expected = granite
    llm, outputs = _generate(path, prompts, tensor_parallel_size=2)
    try:
        assert _tokens(outputs) == expected
        assert_each_of_two_ranks_keeps_its_part_of_the_state(llm)
    finally:
        llm.llm_engine.shutdown()


# The CPU configs widened to heads of 64, the Triton attention's smallest (and to the GPU test's
# longest prompt, tests/gpu/test_linear_attention_gpu.py).
WIDE_GRANITE = {
    **TINY_GRANITE,
    "hidden_size": 256,
    "mamba_n_heads": 16,
    "mamba_d_head": 32,
    "mamba_d_state": 32,
    "max_position_embeddings": 1024,
}
WIDE_CASES = {
    "moe-nope": lambda: GraniteMoeHybridConfig(**WIDE_GRANITE),
    "bamba": lambda: BambaConfig(
        **{key: WIDE_GRANITE[key] for key in TINY_BAMBA}, attn_layer_indices=[1], intermediate_size=96
    ),
}


@pytest.mark.slow  # every kernel interpreted: about 12 s a case
@pytest.mark.parametrize("case", list(WIDE_CASES))
def test_the_triton_path_gives_hf_tokens_under_the_interpreter(
    case: str, make_hybrid_reference: Callable, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a GPU runs -- Triton attention, norms, experts, the Mamba-2 conv and decode step -- on
    the CPU under Triton's interpreter, the layers bound as on a Triton platform: HF's greedy
    tokens over chunked prefills."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs the Triton kernels under Triton's interpreter, on the CPU")
    from pagedllm.layers import custom_op

    path, prompts, expected = make_hybrid_reference(WIDE_CASES[case](), (40, 1, 23), MAX_TOKENS)
    platform = custom_op.platform_for(torch.device("cpu"))
    monkeypatch.setattr(custom_op, "platform_for", lambda device: dataclasses.replace(platform, triton=True))
    llm, outputs = _generate(path, prompts, attention_backend="triton")
    # Bound to the kernels, not to their torch references.
    assert llm.llm_engine.executor.collective_rpc(_mixer_forwards) == [{"_decode_triton"}]
    assert _tokens(outputs) == expected


def _mixer_forwards(worker) -> set[str]:
    model = worker.model_runner.model
    return {mixer.forward_method.__name__ for mixer in model.linear_attention_layers()}


def test_transformers_in_memory_names_load_too(reference: Callable, tmp_path) -> None:
    """A checkpoint written from the HF module's own state dict (``experts.gate_up_proj``,
    ``router.weight``), not through save_pretrained's conversion: the same tokens. (Only the
    experts' names differ: the MoE case.)"""
    path, prompts, expected = reference("moe-nope")
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    state = {name: tensor.contiguous() for name, tensor in hf_model.state_dict().items()}
    assert any(".experts.gate_up_proj" in name for name in state)
    assert any(".router.weight" in name for name in state)
    for name in ("config.json", "generation_config.json"):
        shutil.copy(f"{path}/{name}", tmp_path / name)
    save_file(state, tmp_path / "model.safetensors")
    _, outputs = _generate(str(tmp_path), prompts)
    assert _tokens(outputs) == expected


def test_the_architecture_and_its_model_type_resolve() -> None:
    assert get_model_class(["GraniteMoeHybridForCausalLM"]) is GraniteMoeHybridForCausalLM
    assert get_model_class([], "granitemoehybrid") is GraniteMoeHybridForCausalLM
    assert get_model_class(["BambaForCausalLM"]) is get_model_class([], "bamba") is BambaForCausalLM


def test_state_shapes_follow_granite_s_field_names() -> None:
    config = GraniteMoeHybridConfig(**TINY_GRANITE)
    # Three Mamba-2 layers: conv window over x, B, C (8 x 16 + 2 x 2 x 16 channels, kernel 4 - 1),
    # h [heads, head_dim, d_state]; the attention layer's KV is paged.
    shapes = GraniteMoeHybridForCausalLM.state_shapes(config, 1)
    assert [(s.conv_shape, s.ssm_shape) for s in shapes] == [((192, 3), (8, 16, 16))] * 3
    assert GraniteMoeHybridForCausalLM.num_attention_layers(config) == 1
    assert GraniteMoeHybridForCausalLM.num_attention_layers(config, range(2, 4)) == 0


def test_group_counts_the_ranks_cannot_split_are_refused_naming_the_field() -> None:
    config = GraniteMoeHybridConfig(**TINY_GRANITE)  # 2 groups
    with pytest.raises(
        ValueError, match=r"mamba_n_groups \(2\) must be divisible by tensor_parallel_size \(4\)"
    ):
        GraniteMoeHybridForCausalLM.state_shapes(config, 4)


def test_an_activation_other_than_silu_is_refused(tmp_path) -> None:
    config = GraniteMoeHybridConfig(**{**TINY_GRANITE, "hidden_act": "gelu"})
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="hidden_act must be 'silu'"):
        LLM(str(tmp_path), device="cpu", dtype="float32", load_format="dummy")
