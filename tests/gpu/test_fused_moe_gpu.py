"""The fused MoE kernel on CUDA against the torch path, in float32 and bfloat16, at the CPU tests'
shapes and at Qwen3-30B-A3B's layer (128 experts, top-8, hidden 2048, width 768) for a decode
(64 tokens) and a prefill (8192 tokens); capture in a CUDA graph; ``pagedllm bench moe`` end to
end at a small size. (test_fused_gpu.py runs Qwen3-MoE and Mixtral on CUDA against Hugging Face.)
"""

from __future__ import annotations

import argparse
import itertools
import os

import pytest
import torch

if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("needs CUDA and compiled (not interpreted) Triton kernels", allow_module_level=True)
pytest.importorskip("triton", reason="the fused MoE kernel needs the triton package")

from pagedllm.entrypoints.bench import moe as bench_moe
from pagedllm.kernels.triton.fused_moe import _launch_gemm, default_launch, fused_moe
from pagedllm.kernels.triton.moe_align import moe_align_block_size
from pagedllm.layers.fused_moe import FusedMoE, fused_experts_torch, select_experts

pytestmark = pytest.mark.gpu

DEVICE = torch.device("cuda")
# (num_tokens, num_experts, top_k, hidden_size, intermediate_size)
SHAPES = [
    (1, 4, 1, 64, 32),
    (3, 8, 2, 48, 40),
    (300, 32, 2, 64, 48),
    (64, 128, 8, 2048, 768),
    (8192, 128, 8, 2048, 768),
]


def _inputs(num_tokens, num_experts, top_k, hidden, intermediate, dtype, seed=0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(num_tokens, hidden, device=DEVICE, generator=gen)
    w13 = torch.randn(num_experts, 2 * intermediate, hidden, device=DEVICE, generator=gen) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, intermediate, device=DEVICE, generator=gen) / intermediate**0.5
    logits = torch.randn(num_tokens, num_experts, device=DEVICE, generator=gen)
    weights, ids = select_experts(logits, top_k, renormalize=True)
    return x.to(dtype), w13.to(dtype), w2.to(dtype), weights, ids


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "t{}-e{}-k{}-h{}-i{}".format(*s))
def test_float32_matches_torch_path(shape: tuple) -> None:
    x, w13, w2, weights, ids = _inputs(*shape, torch.float32)
    out = fused_moe(x, w13, w2, weights, ids)
    ref = fused_experts_torch(x, w13, w2, weights, ids)
    torch.testing.assert_close(out, ref, atol=5e-5, rtol=5e-5)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "t{}-e{}-k{}-h{}-i{}".format(*s))
def test_bfloat16_is_as_accurate_as_the_torch_path(shape: tuple) -> None:
    """Both bf16 paths against float32 on the same (bf16-rounded) inputs: the kernel rounds less
    (gate and up stay float32 until silu * up), so its error is at most the torch path's."""
    x, w13, w2, weights, ids = _inputs(*shape, torch.bfloat16)
    exact = fused_experts_torch(x.float(), w13.float(), w2.float(), weights, ids)
    out = fused_moe(x, w13, w2, weights, ids).float()
    ref = fused_experts_torch(x, w13, w2, weights, ids).float()
    scale = exact.abs().max().item()
    torch.testing.assert_close(out, exact, atol=2e-2 * scale, rtol=2e-2)
    assert (out - exact).abs().mean() <= 1.25 * (ref - exact).abs().mean() + 1e-6


@pytest.mark.parametrize("num_tokens", [256, 8192])
def test_output_is_the_same_bits_for_any_order_within_an_expert(num_tokens: int) -> None:
    """The placement's atomics order each expert's pairs arbitrarily: both GEMMs give the same
    bits when every run is reversed, so the order cannot change a token's output."""
    x, w13, w2, weights, ids = _inputs(num_tokens, 128, 8, 2048, 768, torch.bfloat16, seed=5)
    num_pairs = ids.numel()
    launch = default_launch(num_pairs, 128, x.dtype)
    sorted_ids, expert_ids, num_post_padded = moe_align_block_size(ids, launch.block_m, 128)
    reversed_ids = sorted_ids.clone()
    runs = torch.cat([expert_ids.repeat_interleave(launch.block_m), expert_ids.new_tensor([-1])])
    starts = [0, *(torch.nonzero(runs[1:] != runs[:-1]).flatten() + 1).tolist()]
    for start, end in itertools.pairwise(starts):
        run = sorted_ids[start:end]
        real = run[run < num_pairs]
        assert real.numel() > 0 or start >= int(num_post_padded)
        reversed_ids[start : start + real.numel()] = real.flip(0)
    outs = []
    for order in (sorted_ids, reversed_ids):
        act = x.new_empty(num_pairs, 768)
        out = x.new_empty(num_pairs, 2048)
        aligned = (order, expert_ids, num_post_padded)
        _launch_gemm(x, w13, act, weights.contiguous(), *aligned, 8, True, launch)
        _launch_gemm(act, w2, out, weights.contiguous(), *aligned, 1, False, launch)
        outs.append(out)
    assert not torch.equal(sorted_ids, reversed_ids)
    assert torch.equal(outs[0], outs[1])


def test_layer_replays_in_a_cuda_graph() -> None:
    """Routing, sort-and-pad and both GEMMs capture (no host sync, fixed shapes for a token
    count) and replay on new tokens with new routing."""
    num_tokens, num_experts, top_k, hidden, intermediate = 64, 128, 8, 2048, 768
    layer = FusedMoE(num_experts, top_k, hidden, intermediate, renormalize=True).to(DEVICE, torch.bfloat16)
    with torch.no_grad():
        layer.gate_up_proj.normal_(0, 0.02)
        layer.down_proj.normal_(0, 0.02)
    x = torch.empty(num_tokens, hidden, device=DEVICE, dtype=torch.bfloat16)
    logits = torch.empty(num_tokens, num_experts, device=DEVICE, dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.no_grad():
        x.normal_()
        logits.normal_()
        layer(x, logits)  # compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        graph_out = layer(x, logits)
    for _ in range(3):
        x.normal_()
        logits.normal_()
        graph.replay()
        with torch.no_grad():
            expected = layer(x, logits)
        torch.testing.assert_close(graph_out, expected, atol=0, rtol=0)


def test_bench_moe_runs(tmp_path) -> None:
    parser = argparse.ArgumentParser()
    bench_moe.add_cli_args(parser)
    args = parser.parse_args(["--num-tokens", "64", "--output-json", str(tmp_path / "moe.json")])
    (row,) = bench_moe.main(args)["rows"]
    assert row["fused_ms"] > 0 and row["torch_ms"] > 0 and row["experts_touched"] > 100
    assert (tmp_path / "moe.json").is_file()
