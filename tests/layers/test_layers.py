"""Layers against their Hugging Face references, and tensor-parallel sharding over two gloo ranks."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm as HFGemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from pagedllm.layers.activation import SiluAndMul
from pagedllm.layers.layernorm import GemmaRMSNorm, RMSNorm
from pagedllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedllm.layers.logits_processor import LogitsProcessor
from pagedllm.layers.rotary_embedding import RotaryEmbedding, compute_inv_freq, get_rope_parameters
from pagedllm.layers.vocab_parallel_embedding import VocabParallelEmbedding
from pagedllm.models.gemma import SoftCappedLogitsProcessor
from pagedllm.platform import platform_for

REPO_ROOT = Path(__file__).resolve().parents[2]

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
LINEAR_ROPE = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 7, 64), (32, 576), (3, 2048)])
def test_rms_norm_matches_hf_bit_for_bit(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    # Seeded: the inputs must not depend on what earlier tests drew from the global generator.
    torch.manual_seed(0)
    x, residual = torch.randn(*shape).to(dtype), torch.randn(*shape).to(dtype)
    hidden = shape[-1]
    weight = (1 + 0.2 * torch.randn(hidden)).to(dtype)
    ours, ref = RMSNorm(hidden, eps=1e-5).to(dtype), LlamaRMSNorm(hidden, eps=1e-5).to(dtype)
    ours.weight.data.copy_(weight)
    ref.weight.data.copy_(weight)
    # float32 takes the PyTorch formulation on the CPU, bit for bit; bf16 the C++ kernel, whose
    # sum of squares is reduced in another order: a result on a rounding tie may move one ulp.
    kernel = dtype == torch.bfloat16
    assert (ours.forward_method == ours.forward_cpu) == kernel

    def check(got: torch.Tensor, expected: torch.Tensor) -> None:
        if not kernel:
            assert torch.equal(got, expected)
            return
        torch.testing.assert_close(got, expected, atol=0, rtol=2**-7)  # one bf16 ulp
        assert (got != expected).float().mean() < 1e-3

    x_before, residual_before = x.clone(), residual.clone()
    with torch.no_grad():
        check(ours(x.clone()), ref(x))
        assert torch.equal(x, x_before)  # without a residual, the result is a new tensor
        # With one, the fused kernel writes its results over its inputs (the callers' contract).
        out, new_residual = ours(x.clone(), residual.clone())
        assert torch.equal(new_residual, x + residual)
        check(out, ref(x + residual))
        # The reference path's in-place steps never reach its inputs.
        ours.forward_torch(x, residual)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 7, 64), (3, 2048)])
def test_gemma_rms_norm_matches_hf_bit_for_bit(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """The torch path, which the fused kernel's Gemma order is tested against (tests/kernels), is
    HF's GemmaRMSNorm (Qwen3NextRMSNorm is the same code) to the bit."""
    x, residual = torch.randn(*shape).to(dtype), torch.randn(*shape).to(dtype)
    hidden = shape[-1]
    ours, ref = GemmaRMSNorm(hidden, eps=1e-6).to(dtype), HFGemmaRMSNorm(hidden, eps=1e-6).to(dtype)
    weight = (0.2 * torch.randn(hidden)).to(dtype)
    ours.weight.data.copy_(weight)
    ref.weight.data.copy_(weight)
    with torch.no_grad():
        assert torch.equal(ours.forward_torch(x), ref(x))
        out, new_residual = ours.forward_torch(x, residual)
        assert torch.equal(new_residual, x + residual) and torch.equal(out, ref(x + residual))


@pytest.mark.parametrize("rope", [None, LINEAR_ROPE, LLAMA3_ROPE], ids=["default", "linear", "llama3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_matches_hf(rope: dict | None, dtype: torch.dtype) -> None:
    num_heads, num_kv_heads, head_size, num_tokens = 4, 2, 64, 9
    config = LlamaConfig(
        hidden_size=num_heads * head_size,
        num_attention_heads=num_heads,
        max_position_embeddings=16384,
        rope_parameters=rope,
    )
    # Positions far apart, past the llama3 pretraining length, in no particular order.
    positions = torch.tensor([0, 1, 2, 17, 5000, 9000, 16383, 3, 100])
    q = torch.randn(num_tokens, num_heads * head_size).to(dtype)
    k = torch.randn(num_tokens, num_kv_heads * head_size).to(dtype)
    rotary = RotaryEmbedding(head_size, config.max_position_embeddings, get_rope_parameters(config), dtype)
    # forward may rotate its inputs in place (the CPU and Triton kernels do): give it copies.
    q_out, k_out = rotary(positions, q.clone(), k.clone())
    # The CPU kernel rounds as the PyTorch formulation does: equal bit for bit.
    assert rotary.forward_method == rotary.forward_cpu
    q_torch, k_torch = rotary.forward_torch(positions, q, k)
    assert torch.equal(q_out, q_torch) and torch.equal(k_out, k_torch)

    cos, sin = LlamaRotaryEmbedding(config)(q, positions[None])
    # HF's layout: [batch, heads, tokens, head_size].
    q_ref, k_ref = apply_rotary_pos_emb(
        q.view(1, num_tokens, num_heads, head_size).transpose(1, 2),
        k.view(1, num_tokens, num_kv_heads, head_size).transpose(1, 2),
        cos,
        sin,
    )
    torch.testing.assert_close(q_out, q_ref.transpose(1, 2).reshape(num_tokens, -1), atol=1e-5, rtol=0)
    torch.testing.assert_close(k_out, k_ref.transpose(1, 2).reshape(num_tokens, -1), atol=1e-5, rtol=0)


@pytest.mark.parametrize("rope", [LINEAR_ROPE, LLAMA3_ROPE], ids=["linear", "llama3"])
def test_scaled_inv_freq_matches_transformers_rope_init(rope: dict) -> None:
    config = LlamaConfig(
        hidden_size=512, num_attention_heads=4, max_position_embeddings=131072, rope_parameters=rope
    )
    expected, _ = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, torch.device("cpu"))
    torch.testing.assert_close(
        compute_inv_freq(128, get_rope_parameters(config)), expected, atol=0, rtol=1e-6
    )


def test_rope_parameters_from_pre_transformers_5_config() -> None:
    config = SimpleNamespace(rope_theta=500000.0, rope_scaling={"type": "linear", "factor": 2.0})
    assert get_rope_parameters(config) == {
        "type": "linear",
        "rope_type": "linear",
        "factor": 2.0,
        "rope_theta": 5e5,
    }
    assert get_rope_parameters(SimpleNamespace()) == {"rope_type": "default", "rope_theta": 10000.0}


# Long-context types, with lengths short enough that the scaling changes every table row we test.
YARN_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 64,
}
YARN_MSCALE_ROPE = {**YARN_ROPE, "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 16, "truncate": False}
DYNAMIC_ROPE = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "original_max_position_embeddings": 64,
    "short_factor": [1.0 + 0.1 * i for i in range(32)],
    "long_factor": [2.0 + 0.5 * i for i in range(32)],
}


@pytest.mark.parametrize(
    "rope",
    [YARN_ROPE, YARN_MSCALE_ROPE, DYNAMIC_ROPE, LONGROPE],
    ids=["yarn", "yarn-mscale", "dynamic", "longrope"],
)
def test_long_context_rope_table_matches_transformers(rope: dict) -> None:
    """Every row of our cos/sin table against transformers' frequencies and attention factor at
    that position (longrope: short factors before the original length, long ones from it)."""
    max_position = 256
    config = LlamaConfig(
        hidden_size=256, num_attention_heads=4, max_position_embeddings=max_position, rope_parameters=rope
    )
    rotary = RotaryEmbedding(64, max_position, get_rope_parameters(config), torch.float32)
    init = ROPE_INIT_FUNCTIONS[rope["rope_type"]]
    for position in (0, 1, 63, 64, 65, 200, 255):
        # transformers' dynamic update computes the frequencies for a forward call whose largest
        # position is this one.
        inv_freq, factor = init(config, torch.device("cpu"), seq_len=position + 1)
        angles = position * inv_freq
        expected = torch.cat([angles.cos(), angles.sin()]) * factor
        torch.testing.assert_close(rotary.cos_sin_cache[position], expected, atol=1e-6, rtol=0)


def test_unsupported_rope_type_is_named() -> None:
    with pytest.raises(ValueError, match=r"rope_type 'ntk-by-parts'.*supported.*'default', 'dynamic'"):
        compute_inv_freq(64, {"rope_type": "ntk-by-parts", "rope_theta": 10000.0, "factor": 4.0})


def test_partial_rotary_matches_transformers() -> None:
    """Phi-3's partial rotation (the first 3/4 of each head) against transformers' own."""
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb as phi3_apply_rotary

    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}
    config = Phi3Config(
        hidden_size=128, num_attention_heads=2, max_position_embeddings=64, rope_parameters=rope
    )
    rotary = RotaryEmbedding(64, 64, get_rope_parameters(config), torch.float32)
    assert rotary.rotary_dim == 48 and rotary.is_partial
    positions = torch.tensor([0, 5, 17, 63])
    q, k = torch.randn(4, 2 * 64), torch.randn(4, 64)
    ours_q, ours_k = rotary(positions, q, k)
    cos, sin = Phi3RotaryEmbedding(config)(q, positions[None])
    ref_q, ref_k = phi3_apply_rotary(
        q.view(1, 4, 2, 64).transpose(1, 2), k.view(1, 4, 1, 64).transpose(1, 2), cos, sin
    )
    torch.testing.assert_close(ours_q, ref_q.transpose(1, 2).reshape(4, -1), atol=1e-6, rtol=0)
    torch.testing.assert_close(ours_k, ref_k.transpose(1, 2).reshape(4, -1), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="partial_rotary_factor must be in"):
        compute_inv_freq(64, {**rope, "partial_rotary_factor": 1.5})


def test_rope_parameters_per_layer_type() -> None:
    config = SimpleNamespace(
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        }
    )
    assert get_rope_parameters(config, "sliding_attention") == {"rope_type": "default", "rope_theta": 10000.0}
    assert get_rope_parameters(config, "full_attention")["rope_theta"] == 1e6


def test_silu_and_mul() -> None:
    x = torch.randn(5, 2 * 24)
    torch.testing.assert_close(SiluAndMul()(x), F.silu(x[:, :24]) * x[:, 24:])


def test_packed_linear_loaders_place_each_shard() -> None:
    hidden, head_size = 16, 4
    wq, wk, wv = (
        torch.randn(4 * head_size, hidden),
        torch.randn(head_size, hidden),
        torch.randn(head_size, hidden),
    )
    qkv = QKVParallelLinear(hidden, head_size, total_num_heads=4, total_num_kv_heads=1, bias=False)
    for shard_id, weight in (("k", wk), ("v", wv), ("q", wq)):  # any order
        qkv.weight.weight_loader(qkv.weight, weight, shard_id)
    assert torch.equal(qkv.weight, torch.cat([wq, wk, wv]))

    packed = MergedColumnParallelLinear(hidden, [8, 8], bias=True)
    gate_up, bias = torch.randn(16, hidden), torch.randn(16)
    packed.weight.weight_loader(packed.weight, gate_up)  # a checkpoint that stores them fused
    packed.bias.weight_loader(packed.bias, bias[:8], 0)
    packed.bias.weight_loader(packed.bias, bias[8:], 1)
    assert torch.equal(packed.weight, gate_up) and torch.equal(packed.bias, bias)


def test_weight_loaders_reject_mismatches() -> None:
    row = RowParallelLinear(16, 8, bias=False)
    with pytest.raises(
        ValueError, match=r"shape mismatch: checkpoint \(8, 12\) should have 16 entries along dim 1"
    ):
        row.weight.weight_loader(row.weight, torch.randn(8, 12))
    with pytest.raises(ValueError, match=r"shape mismatch: parameter slice \(8, 16\), checkpoint \(9, 16\)"):
        row.weight.weight_loader(row.weight, torch.randn(9, 16))
    qkv = QKVParallelLinear(16, 4, 4, 2, bias=False)
    with pytest.raises(ValueError, match="shard_id must be 'q', 'k' or 'v'"):
        qkv.weight.weight_loader(qkv.weight, torch.randn(8, 16), "x")


def test_logits_are_float32_over_the_vocabulary() -> None:
    table = torch.randn(10, 8, dtype=torch.bfloat16)
    embedding = VocabParallelEmbedding(10, 8).to(torch.bfloat16)
    embedding.weight.weight_loader(embedding.weight, table)
    hidden = torch.randn(3, 8, dtype=torch.bfloat16)
    logits = LogitsProcessor(10)(embedding, hidden)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, (hidden @ table.T).float())
    assert torch.equal(embedding(torch.tensor([3, 0, 9])), table[[3, 0, 9]])


def test_a_subclass_s_forward_still_runs_around_the_chosen_path() -> None:
    """Gemma 2's soft cap is a LogitsProcessor subclass whose forward wraps the processor's: the
    forward chosen for the device must not replace it."""
    table = torch.randn(10, 8) * 4
    embedding = VocabParallelEmbedding(10, 8)
    embedding.weight.weight_loader(embedding.weight, table)
    hidden = torch.randn(3, 8)
    capped = SoftCappedLogitsProcessor(10, cap=2.0)(embedding, hidden)
    torch.testing.assert_close(capped, torch.tanh(hidden @ table.T / 2.0) * 2.0)


def test_logits_widen_inside_the_matmul_only_on_one_cuda_rank_in_16_bits() -> None:
    """Where cuBLAS can write float32 from its accumulators (one CUDA rank, a 16-bit model), the
    logits skip the copy that widens them; elsewhere (the CPU, float32, a sharded vocabulary) the
    reference path runs. The CUDA path's values are checked on the GPU (tests/gpu/test_fused_gpu.py)."""
    processor = LogitsProcessor(10)
    cpu = platform_for(torch.device("cpu"))
    cuda = dataclasses.replace(cpu, device_type="cuda", device_capability=(9, 0))
    assert processor.forward_method == processor.forward_torch
    assert processor.dispatch_forward(cuda, torch.bfloat16) == processor.forward_cuda
    assert processor.dispatch_forward(cuda, torch.float16) == processor.forward_cuda
    assert processor.dispatch_forward(cuda, torch.float32) == processor.forward_torch
    assert processor.dispatch_forward(cpu, torch.bfloat16) == processor.forward_torch


@pytest.mark.slow
def test_tensor_parallel_layers_over_two_gloo_ranks(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    worker = Path(__file__).with_name("tp_worker.py")
    init_file = tmp_path / "init"
    procs = [
        subprocess.Popen(
            [sys.executable, str(worker), str(rank), "2", str(init_file)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    outputs = [proc.communicate(timeout=120)[0] for proc in procs]
    for rank, (proc, output) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, f"rank {rank} failed:\n{output}"


@pytest.mark.parametrize(
    "rope",
    [
        None,
        LLAMA3_ROPE,
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512},
        {
            "rope_type": "longrope",
            "original_max_position_embeddings": 512,
            "short_factor": [1.0 + 0.05 * i for i in range(32)],
            "long_factor": [1.5 + 0.5 * i for i in range(32)],
        },
    ],
    ids=["default", "llama3", "yarn", "longrope"],
)
def test_unbounded_rotary_equals_the_table_and_keeps_relative_rotations_far_past_it(
    rope: dict | None,
) -> None:
    """Attention sinks run past max_position: cos/sin computed per step equal the table where it
    exists, and far past it a query and a key still score by their distance alone."""
    config = LlamaConfig(
        hidden_size=128, num_attention_heads=2, max_position_embeddings=2048, rope_parameters=rope
    )
    params = get_rope_parameters(config)
    table = RotaryEmbedding(64, 2048, params, torch.float32)
    unbounded = RotaryEmbedding(64, 2048, params, torch.float32, unbounded=True)
    positions = torch.tensor([0, 7, 511, 512, 1500, 2047])
    q, k = torch.randn(6, 128), torch.randn(6, 64)
    # The table's angles are float32 products (as the reference's): ~1e-4 rad off at 2047.
    # forward may rotate its inputs in place (the CPU and Triton kernels do): give it copies.
    expected_q, expected_k = table(positions, q.clone(), k.clone())
    for expected, got in zip((expected_q, expected_k), unbounded(positions, q.clone(), k.clone())):
        torch.testing.assert_close(got, expected, atol=5e-4, rtol=0)
    torch.testing.assert_close(unbounded.rotate_query(positions, q), expected_q, atol=5e-4, rtol=0)

    def score(query_position: int, key_position: int) -> torch.Tensor:
        qr = unbounded.rotate_query(torch.tensor([query_position]), q[:1])
        _, kr = unbounded(torch.tensor([key_position]), q[:1].clone(), k[:1].clone())
        return (qr.view(2, 64) * kr.view(1, 64)).sum(-1)

    far = 10_000_000
    torch.testing.assert_close(score(far + 37, far), score(1037, 1000), atol=1e-3, rtol=0)
