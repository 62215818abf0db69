"""The MoE glue kernels on CUDA at W6's layer (Qwen3-Next-style: 16 experts, top-8, hidden 2048,
expert and shared-expert width 512, renormalised) for a decode step (256 tokens) and a prefill
step (16,384 tokens), in bfloat16, against the torch path: the router (``topk_softmax`` against
``select_experts``), the combine (``moe_sum`` against torch's sum and the shared expert's
sigmoid, product and add), the experts' layer end to end with its shared expert, and its capture
in a CUDA graph. tests/kernels/test_moe_routing.py runs the same kernels on the CPU.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("needs CUDA and compiled (not interpreted) Triton kernels", allow_module_level=True)
pytest.importorskip("triton", reason="the MoE kernels need the triton package")

from pagedllm.kernels.triton.fused_moe import moe_sum
from pagedllm.kernels.triton.moe_routing import topk_softmax
from pagedllm.layers.fused_moe import FusedMoE, select_experts

pytestmark = pytest.mark.gpu

DEVICE = torch.device("cuda")
NUM_EXPERTS, TOP_K, HIDDEN, INTERMEDIATE = 16, 8, 2048, 512
TOKEN_COUNTS = [256, 16384]


def _randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    return (scale * torch.randn(*shape, device=DEVICE, generator=gen)).to(torch.bfloat16)


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("num_tokens", TOKEN_COUNTS)
def test_topk_softmax_matches_select_experts(num_tokens: int, renormalize: bool) -> None:
    """ids: descending logit, ties (frequent in bf16) to the lowest expert, and a top-k of torch's
    softmax; its ids wherever its order is unique. Weights: a few float32 ulps (Triton's exp is
    not torch's)."""
    logits = _randn(num_tokens, NUM_EXPERTS, seed=num_tokens, scale=2.0)
    weights, ids = topk_softmax(logits, TOP_K, renormalize)
    ref_weights, ref_ids = select_experts(logits, TOP_K, renormalize)
    ranked = torch.sort(logits.float(), dim=-1, descending=True, stable=True).indices[:, :TOP_K]
    assert torch.equal(ids, ranked)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    assert torch.equal(probs.gather(1, ids), probs.gather(1, ref_ids))
    chosen = probs.gather(1, ref_ids)
    next_best = torch.sort(probs, dim=-1, descending=True).values[:, TOP_K]
    unique = (chosen[:, :-1] > chosen[:, 1:]).all(dim=-1) & (chosen[:, -1] > next_best)
    assert unique.any() and torch.equal(ids[unique], ref_ids[unique])
    torch.testing.assert_close(weights, ref_weights, rtol=1e-5, atol=1e-9)
    for rows in (slice(0, 1), slice(100, 164)):  # a token's result is the same bits in any batch
        alone = topk_softmax(logits[rows], TOP_K, renormalize)
        assert torch.equal(alone[0], weights[rows]) and torch.equal(alone[1], ids[rows])


@pytest.mark.parametrize("num_tokens", TOKEN_COUNTS)
def test_moe_sum_matches_the_torch_path(num_tokens: int) -> None:
    """Without a shared expert: the slot-order float32 loop, to the bit. With one: at least as
    close to float64 as torch's path (which rounds the routed sum, the product and the add), and
    batch-invariant."""
    slots = _randn(num_tokens, TOP_K, HIDDEN, seed=1, scale=0.05)
    shared = _randn(num_tokens, HIDDEN, seed=2, scale=0.05)
    gate = _randn(num_tokens, 1, seed=3, scale=3.0)
    total = slots[:, 0].to(torch.float32, copy=True)
    for j in range(1, TOP_K):
        total += slots[:, j]
    assert torch.equal(moe_sum(slots), total.to(torch.bfloat16))

    out = moe_sum(slots, shared, gate)
    torch_path = slots.float().sum(dim=1).to(torch.bfloat16) + torch.sigmoid(gate) * shared
    exact = slots.double().sum(dim=1) + torch.sigmoid(gate.double()) * shared.double()
    scale = exact.abs().max().item()
    torch.testing.assert_close(out.double(), exact, atol=1e-2 * scale, rtol=2**-7)
    assert (out.double() - exact).abs().mean() <= (torch_path.double() - exact).abs().mean()
    for rows in (slice(0, 1), slice(100, 164)):
        assert torch.equal(moe_sum(slots[rows], shared[rows], gate[rows]), out[rows])


def _layer(seed: int) -> FusedMoE:
    layer = FusedMoE(NUM_EXPERTS, TOP_K, HIDDEN, INTERMEDIATE, renormalize=True).to(DEVICE, torch.bfloat16)
    with torch.no_grad():
        layer.gate_up_proj.copy_(_randn(*layer.gate_up_proj.shape, seed=seed, scale=HIDDEN**-0.5))
        layer.down_proj.copy_(_randn(*layer.down_proj.shape, seed=seed + 1, scale=INTERMEDIATE**-0.5))
    return layer


@pytest.mark.parametrize("num_tokens", TOKEN_COUNTS)
def test_experts_with_a_shared_expert_match_the_torch_path(num_tokens: int) -> None:
    """FusedMoE on CUDA (the routing kernel, the grouped GEMMs, the fused combine) against its
    torch path (select_experts, the torch experts, HF's rounding of the shared term), both in bf16
    against float32 on the same inputs: the kernels' error at most the torch path's, give or take."""
    layer = _layer(seed=10)
    assert layer.route == layer.route_triton and layer.forward_method == layer.forward_triton
    x = _randn(num_tokens, HIDDEN, seed=11)
    logits = _randn(num_tokens, NUM_EXPERTS, seed=12, scale=2.0)
    shared = _randn(num_tokens, HIDDEN, seed=13, scale=0.1)
    gate = _randn(num_tokens, 1, seed=14, scale=3.0)
    with torch.no_grad():
        out = layer(x, logits, shared, gate).float()
        # The kernel's routing for both (bf16 logits tie often, and select_experts may break a
        # tie at the k-th expert the other way: test_topk_softmax_matches_select_experts).
        routing = layer.route(logits)
        ref = layer.forward_torch(x, *routing, shared, gate).float()
        layer.float()
        exact = layer.forward_torch(x.float(), *routing, shared.float(), gate.float())
    scale = exact.abs().max().item()
    torch.testing.assert_close(out, exact, atol=2e-2 * scale, rtol=2e-2)
    assert (out - exact).abs().mean() <= 1.25 * (ref - exact).abs().mean() + 1e-6


def test_experts_with_a_shared_expert_replay_in_a_cuda_graph() -> None:
    """Router, sort-and-pad, both GEMMs and the combine capture and replay on new inputs."""
    num_tokens = TOKEN_COUNTS[0]
    layer = _layer(seed=20)
    inputs = [
        torch.empty(num_tokens, HIDDEN, device=DEVICE, dtype=torch.bfloat16),
        torch.empty(num_tokens, NUM_EXPERTS, device=DEVICE, dtype=torch.bfloat16),
        torch.empty(num_tokens, HIDDEN, device=DEVICE, dtype=torch.bfloat16),
        torch.empty(num_tokens, 1, device=DEVICE, dtype=torch.bfloat16),
    ]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.no_grad():
        for t in inputs:
            t.normal_()
        layer(*inputs)  # compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        graph_out = layer(*inputs)
    for _ in range(3):
        for t in inputs:
            t.normal_()
        graph.replay()
        with torch.no_grad():
            expected = layer(*inputs)
        torch.testing.assert_close(graph_out, expected, atol=0, rtol=0)


@pytest.mark.parametrize("num_tokens", TOKEN_COUNTS)
def test_the_shared_expert_absorbed_as_an_expert_matches_it_apart(num_tokens: int) -> None:
    """W6's shared expert (width 512, one expert more) absorbed into the experts, its gate the
    router's last column, against the same layer adding it apart (its own GEMMs, then the fused
    combine), both bf16 against the float32 torch path: no further from it than the apart path,
    give or take; and it captures and replays in a CUDA graph."""
    layer = _layer(seed=30)
    x = _randn(num_tokens, HIDDEN, seed=31)
    logits = _randn(num_tokens, NUM_EXPERTS, seed=32, scale=2.0)
    gate = _randn(num_tokens, 1, seed=33, scale=3.0)
    shared_gate_up = _randn(2 * INTERMEDIATE, HIDDEN, seed=34, scale=HIDDEN**-0.5)
    shared_down = _randn(HIDDEN, INTERMEDIATE, seed=35, scale=INTERMEDIATE**-0.5)
    with torch.no_grad():
        g, u = (x @ shared_gate_up.T).chunk(2, dim=-1)
        shared = (torch.nn.functional.silu(g) * u) @ shared_down.T
        apart = layer(x, logits, shared, gate).float()
        routing = layer.route(logits)
        g32, u32 = (x.float() @ shared_gate_up.float().T).chunk(2, dim=-1)
        shared32 = (torch.nn.functional.silu(g32) * u32) @ shared_down.float().T
        exact = layer.float().forward_torch(x.float(), *routing, shared32, gate.float())
        layer.to(torch.bfloat16)
        assert layer.can_absorb_shared_expert(INTERMEDIATE)
        layer.absorb_shared_expert(shared_gate_up, shared_down, gate_in_logits=True)
        router_logits = torch.cat([logits, gate], dim=1)
        absorbed = layer(x, router_logits).float()
    scale = exact.abs().max().item()
    torch.testing.assert_close(absorbed, exact, atol=2e-2 * scale, rtol=2e-2)
    assert (absorbed - exact).abs().mean() <= 1.25 * (apart - exact).abs().mean() + 1e-6

    graph = torch.cuda.CUDAGraph()
    static_x, static_logits = x.clone(), router_logits.clone()
    with torch.cuda.graph(graph), torch.no_grad():
        graph_out = layer(static_x, static_logits)
    static_x.copy_(_randn(num_tokens, HIDDEN, seed=36))
    graph.replay()
    with torch.no_grad():
        torch.testing.assert_close(graph_out, layer(static_x, static_logits), atol=0, rtol=0)
