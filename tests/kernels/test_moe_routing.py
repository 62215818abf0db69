"""The MoE glue kernels: the router's softmax and top-k (``moe_routing.topk_softmax``) against
``select_experts``, and the combine (``fused_moe.moe_sum``: the slots in slot order, plus a gated
shared expert) against a float64 reference; both batch-invariant; the experts' layer with a shared
expert on its Triton path against its torch path.

Runs on the CPU under TRITON_INTERPRET=1 (set by conftest.py when there is no GPU), else on CUDA;
tests/gpu/test_moe_routing_gpu.py adds bfloat16 outputs and W6's shapes on the device.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

pytest.importorskip("triton", reason="the MoE kernels need the triton package")

from pagedllm.kernels.triton.fused_moe import fused_moe, moe_sum
from pagedllm.kernels.triton.moe_routing import MAX_EXPERTS, topk_softmax
from pagedllm.layers.fused_moe import FusedMoE, fused_experts_torch, select_experts
from pagedllm.layers.fused_moe.router import append_shared_slots

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)
DEVICE = torch.device("cpu" if INTERPRET else "cuda")
# Triton's interpreter stores bfloat16 by truncating (a GPU rounds to nearest): bfloat16 outputs
# are compared on the GPU only. Reading bfloat16 (the router's logits) is exact everywhere.
BF16_OUTPUT = pytest.param(
    torch.bfloat16,
    marks=pytest.mark.skipif(INTERPRET, reason="Triton's interpreter truncates bfloat16 stores"),
)

ROUTER_DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# The weights' relative tolerance: a few float32 ulps under the interpreter (numpy's exp); on CUDA
# Triton's float32 exp is ex2.approx of x * log2(e), within ~1e-6 for logits a dozen apart.
WEIGHT_RTOL = 2e-6 if INTERPRET else 1e-5
EXPERT_COUNTS = [2, 8, 16, 60, 64, 128, 256]
TOKEN_COUNTS = [1, 5, 64, 300]


def _logits(num_tokens: int, num_experts: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (2 * torch.randn(num_tokens, num_experts, generator=gen)).to(dtype).to(DEVICE)


def _check_router(logits: torch.Tensor, top_k: int, renormalize: bool) -> None:
    """topk_softmax against select_experts on the same logits.

    ids: the documented rule exactly (descending logit, ties to the lowest index: a stable sort);
    select_experts' probabilities at those ids equal its own top-k values, bit for bit (so the ids
    are a top-k of its softmax); and its ids wherever its order is unique (torch.topk orders ties
    as it likes). Weights: float32 softmax to a few ulps."""
    weights, ids = topk_softmax(logits, top_k, renormalize)
    ref_weights, ref_ids = select_experts(logits, top_k, renormalize)
    assert ids.dtype == ref_ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert ids.shape == weights.shape == (logits.shape[0], top_k)
    ranked = torch.sort(logits.float(), dim=-1, descending=True, stable=True).indices[:, :top_k]
    assert torch.equal(ids, ranked)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    assert torch.equal(probs.gather(1, ids), probs.gather(1, ref_ids))
    next_best = torch.sort(probs, dim=-1, descending=True).values[:, top_k : top_k + 1]
    chosen = probs.gather(1, ref_ids)
    unique = (chosen[:, :-1] > chosen[:, 1:]).all(dim=-1)
    if next_best.shape[1]:
        unique &= chosen[:, -1] > next_best[:, 0]
    assert torch.equal(ids[unique], ref_ids[unique])
    torch.testing.assert_close(weights, ref_weights, rtol=WEIGHT_RTOL, atol=1e-9)


@pytest.mark.parametrize("dtype", ROUTER_DTYPES, ids=str)
@pytest.mark.parametrize("num_experts", EXPERT_COUNTS)
def test_topk_softmax_matches_select_experts_for_every_top_k(num_experts: int, dtype: torch.dtype) -> None:
    """Every top_k from 1 to min(E, 10), renormalised and not, at 1 and 5 tokens (one program,
    mostly past the end)."""
    for num_tokens in TOKEN_COUNTS[:2]:
        logits = _logits(num_tokens, num_experts, dtype, seed=num_tokens)
        for top_k in range(1, min(num_experts, 10) + 1):
            for renormalize in (False, True):
                _check_router(logits, top_k, renormalize)


@pytest.mark.parametrize("dtype", ROUTER_DTYPES, ids=str)
@pytest.mark.parametrize("num_experts", EXPERT_COUNTS)
def test_topk_softmax_matches_select_experts_over_many_programs(num_experts: int, dtype: torch.dtype) -> None:
    """64 and 300 tokens: several programs (16 or 8 tokens each), the last one at 300 partly past
    the end; the smallest, a middle and the largest top_k (every one is above)."""
    for num_tokens in TOKEN_COUNTS[2:]:
        logits = _logits(num_tokens, num_experts, dtype, seed=num_tokens)
        for top_k in sorted({1, min(num_experts, 8), min(num_experts, 10)}):
            _check_router(logits, top_k, renormalize=top_k % 2 == 0)


@pytest.mark.parametrize("num_experts,top_k", [(512, 10), (1000, 8), (MAX_EXPERTS, 4)])
def test_topk_softmax_holds_wide_expert_rows(num_experts: int, top_k: int) -> None:
    # Odd widths mask the row's padding; the widest is one token a program.
    _check_router(_logits(19, num_experts, torch.bfloat16, seed=num_experts), top_k, renormalize=True)


def test_ties_go_to_the_lowest_expert() -> None:
    neg_inf = float("-inf")
    logits = torch.tensor(
        [
            [1.0, 3.0, 3.0, 2.0, 3.0, 0.0, 2.0, 2.0],  # a three-way tie, then a tie across the cut
            [0.5] * 8,  # all equal
            [neg_inf, 0.0, neg_inf, 1.0, neg_inf, neg_inf, neg_inf, neg_inf],  # past the finite ones
            [4.0, 4.0, 4.0, 4.0, 4.0, 4.0, 4.0, 5.0],
        ],
        device=DEVICE,
    )
    weights, ids = topk_softmax(logits, 5, renormalize=False)
    assert ids.tolist() == [[1, 2, 4, 3, 6], [0, 1, 2, 3, 4], [3, 1, 0, 2, 4], [7, 0, 1, 2, 3]]
    probs = torch.softmax(logits, dim=-1)
    assert torch.equal(probs.gather(1, ids), torch.topk(probs, 5).values)
    torch.testing.assert_close(weights, probs.gather(1, ids), rtol=WEIGHT_RTOL, atol=0)
    assert torch.equal(weights[2, 2:], torch.zeros(3, device=DEVICE))
    for dtype in (torch.bfloat16, torch.float16):  # the same rule on 16-bit logits
        assert topk_softmax(logits.to(dtype), 5, renormalize=True)[1].tolist() == ids.tolist()


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's NaNs
def test_nan_logits_still_route_to_experts_that_exist() -> None:
    """A broken row must not send the grouped GEMMs past the experts: distinct, in-range ids."""
    logits = torch.randn(3, 6, device=DEVICE)
    logits[1] = float("nan")
    logits[2, 4] = float("nan")
    _, ids = topk_softmax(logits, 4, renormalize=True)
    for row in ids.tolist():
        assert len(set(row)) == 4 and all(0 <= e < 6 for e in row)


def test_topk_softmax_is_batch_invariant() -> None:
    """A token's weights are the same bits alone as among 300 (the tiles depend on E alone)."""
    logits = _logits(300, 60, torch.float32, seed=7)
    weights, ids = topk_softmax(logits, 8, renormalize=True)
    for rows in (slice(0, 1), slice(7, 9), slice(100, 164), slice(299, 300)):
        alone = topk_softmax(logits[rows], 8, renormalize=True)
        assert torch.equal(alone[0], weights[rows]) and torch.equal(alone[1], ids[rows]), rows


def test_topk_softmax_reads_strided_logits_and_no_tokens() -> None:
    wide = _logits(37, 40, torch.float32, seed=8)
    logits = wide[:, 3:35]  # row stride 40
    weights, ids = topk_softmax(logits, 6, renormalize=False)
    contiguous = topk_softmax(logits.contiguous(), 6, renormalize=False)
    assert torch.equal(weights, contiguous[0]) and torch.equal(ids, contiguous[1])
    empty = topk_softmax(logits[:0], 6, renormalize=True)
    assert empty[0].shape == empty[1].shape == (0, 6)


@pytest.mark.parametrize("shared_gate", [False, True])
@pytest.mark.parametrize("num_experts,top_k,num_shared", [(16, 8, 1), (4, 2, 3), (60, 4, 2), (512, 10, 1)])
def test_topk_softmax_appends_the_shared_slots(
    num_experts: int, top_k: int, num_shared: int, shared_gate: bool
) -> None:
    """Absorbed shared experts: the routed slots as without them (the gate column, when there is
    one, is no expert), then ids E.. weighted 1 or by the sigmoid of the last column, outside the
    renormalisation: append_shared_slots's result."""
    logits = _logits(37, num_experts + int(shared_gate), torch.bfloat16, seed=num_experts)
    routed_logits = logits[:, :num_experts]
    gate = logits[:, num_experts:] if shared_gate else None
    weights, ids = topk_softmax(logits, top_k, True, num_shared, shared_gate)
    assert weights.shape == ids.shape == (37, top_k + num_shared)
    routed = topk_softmax(routed_logits, top_k, True)
    assert torch.equal(ids[:, :top_k], routed[1])
    torch.testing.assert_close(weights[:, :top_k], routed[0], rtol=WEIGHT_RTOL, atol=1e-9)
    ref_weights, ref_ids = append_shared_slots(*routed, num_experts, num_shared, gate)
    assert torch.equal(ids, ref_ids)
    assert ids[:, top_k:].tolist() == [list(range(num_experts, num_experts + num_shared))] * 37
    torch.testing.assert_close(weights, ref_weights, rtol=WEIGHT_RTOL, atol=1e-9)
    if not shared_gate:
        assert torch.equal(weights[:, top_k:], torch.ones(37, num_shared, device=DEVICE))


def test_topk_softmax_refuses_what_it_cannot_route() -> None:
    with pytest.raises(ValueError, match=rf"at most {MAX_EXPERTS} experts, got {MAX_EXPERTS + 1}"):
        topk_softmax(torch.zeros(1, MAX_EXPERTS + 1, device=DEVICE), 2, True)
    with pytest.raises(ValueError, match=r"top_k must be in \[1, num_experts=4\], got 5"):
        topk_softmax(torch.zeros(1, 4, device=DEVICE), 5, True)
    with pytest.raises(ValueError, match=r"top_k must be in \[1, num_experts=3\], got 4"):
        topk_softmax(torch.zeros(1, 4, device=DEVICE), 4, True, num_shared=1, shared_gate=True)
    with pytest.raises(ValueError, match="shared_gate needs a shared expert"):
        topk_softmax(torch.zeros(1, 4, device=DEVICE), 2, True, shared_gate=True)


# --- moe_sum ------------------------------------------------------------------------------------

# (num_tokens, top_k, hidden_size): one slot; a width no multiple of the 1024-column block;
# W6's top-8 and width over a few tokens.
SUM_SHAPES = [(1, 1, 8), (37, 3, 100), (5, 8, 2048), (64, 2, 1500)]
SUM_TOLERANCES = {torch.float32: (1e-6, 1e-6), torch.float16: (1e-3, 1e-3), torch.bfloat16: (8e-3, 8e-3)}


def _combine_inputs(num_tokens: int, top_k: int, hidden: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    slots = torch.randn(num_tokens, top_k, hidden, generator=gen)
    shared = torch.randn(num_tokens, hidden, generator=gen)
    gate = 3 * torch.randn(num_tokens, 1, generator=gen)
    return [t.to(dtype).to(DEVICE) for t in (slots, shared, gate)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, BF16_OUTPUT], ids=str)
@pytest.mark.parametrize("shape", SUM_SHAPES, ids=lambda s: "t{}-k{}-h{}".format(*s))
def test_moe_sum_matches_float64(shape: tuple, dtype: torch.dtype) -> None:
    slots, shared, gate = _combine_inputs(*shape, dtype)
    routed = slots.double().sum(dim=1)
    atol, rtol = SUM_TOLERANCES[dtype]
    out = moe_sum(slots)
    assert out.dtype == dtype and out.shape == (shape[0], shape[2])
    torch.testing.assert_close(out.double(), routed, atol=atol, rtol=rtol)
    with_shared = moe_sum(slots, shared, gate)
    expected = routed + torch.sigmoid(gate.double()) * shared.double()
    torch.testing.assert_close(with_shared.double(), expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_moe_sum_adds_the_slots_in_slot_order(dtype: torch.dtype) -> None:
    """``((s0 + s1) + s2) + ...`` in float32, rounded once: the bits of that loop in torch."""
    slots, _, _ = _combine_inputs(45, 8, 300, dtype, seed=1)
    total = slots[:, 0].to(torch.float32, copy=True)
    for j in range(1, slots.shape[1]):
        total += slots[:, j]
    assert torch.equal(moe_sum(slots), total.to(dtype))


def test_moe_sum_is_batch_invariant() -> None:
    slots, shared, gate = _combine_inputs(300, 8, 200, torch.float16, seed=2)
    batch = moe_sum(slots, shared, gate)
    for rows in (slice(0, 1), slice(7, 9), slice(100, 164), slice(299, 300)):
        assert torch.equal(moe_sum(slots[rows], shared[rows], gate[rows]), batch[rows]), rows


def test_moe_sum_reads_strided_inputs() -> None:
    """Slots of a wider pair buffer, a shared output with padded rows, the gate a column of two."""
    slots, shared, gate = _combine_inputs(9, 4, 96, torch.float32, seed=3)
    wide_slots = torch.randn(9, 5, 96, device=DEVICE)
    wide_slots[:, :4] = slots
    wide_shared = torch.randn(9, 128, device=DEVICE)
    wide_shared[:, :96] = shared
    gates = torch.cat([torch.randn_like(gate), gate], dim=1)
    out = moe_sum(wide_slots[:, :4], wide_shared[:, :96], gates[:, 1:])
    assert torch.equal(out, moe_sum(slots, shared, gate))


def test_moe_sum_needs_both_shared_tensors() -> None:
    slots, shared, _ = _combine_inputs(2, 2, 8, torch.float32)
    with pytest.raises(ValueError, match="both its output and its gate"):
        moe_sum(slots, shared)
    assert moe_sum(slots[:0], shared[:0], shared[:0, :1]).shape == (0, 8)


# --- the experts with a shared expert -----------------------------------------------------------


def _experts_inputs(num_tokens: int, num_experts: int, top_k: int, hidden: int, intermediate: int, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen)
    w13 = torch.randn(num_experts, 2 * intermediate, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, intermediate, generator=gen) / intermediate**0.5
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    shared = torch.randn(num_tokens, hidden, generator=gen)
    gate = torch.randn(num_tokens, 1, generator=gen)
    return [t.to(DEVICE) for t in (x, w13, w2, logits, shared, gate)]


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_fused_moe_adds_a_gated_shared_expert(batch_invariant: bool) -> None:
    x, w13, w2, logits, shared, gate = _experts_inputs(40, 16, 8, 64, 32, seed=4)
    weights, ids = select_experts(logits, 8, renormalize=True)
    out = fused_moe(
        x, w13, w2, weights, ids, batch_invariant=batch_invariant, shared=shared, shared_gate=gate
    )
    expected = fused_experts_torch(x, w13, w2, weights, ids) + torch.sigmoid(gate) * shared
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


def test_the_experts_triton_path_routes_and_adds_the_shared_expert_as_the_torch_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """FusedMoE bound to a Triton platform (the kernels interpreted on the CPU) takes the routing
    kernel and fuses the shared term; bound to this device's, the torch path adds it as Hugging
    Face does: ``routed + sigmoid(gate) * shared``, to the bit."""
    from pagedllm.layers import custom_op

    x, w13, w2, logits, shared, gate = _experts_inputs(33, 16, 8, 64, 32, seed=5)
    reference = FusedMoE(16, 8, 64, 32, renormalize=True).to(DEVICE)
    platform = custom_op.platform_for(torch.device(DEVICE))
    monkeypatch.setattr(custom_op, "platform_for", lambda device: dataclasses.replace(platform, triton=True))
    layer = FusedMoE(16, 8, 64, 32, renormalize=True).to(DEVICE)
    assert layer.route == layer.route_triton and layer.forward_method == layer.forward_triton
    for experts in (reference, layer):
        experts.gate_up_proj.data.copy_(w13)
        experts.down_proj.data.copy_(w2)
    if not INTERPRET:  # on CUDA the reference binds to the Triton path too: point it at torch's
        reference.route, reference.forward_method = reference.route_torch, reference.forward_torch
    expected = reference(x, logits, shared, gate)
    routed = fused_experts_torch(x, w13, w2, *select_experts(logits, 8, renormalize=True))
    assert torch.equal(expected, routed + torch.sigmoid(gate) * shared)
    torch.testing.assert_close(layer(x, logits, shared, gate), expected, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(layer(x, logits), routed, atol=2e-5, rtol=2e-5)


def _triton_experts(monkeypatch: pytest.MonkeyPatch, *args, **kwargs) -> FusedMoE:
    """A FusedMoE bound to a Triton platform (its kernels interpreted on the CPU)."""
    from pagedllm.layers import custom_op

    platform = custom_op.platform_for(torch.device(DEVICE))
    with monkeypatch.context() as patch:
        patch.setattr(custom_op, "platform_for", lambda device: dataclasses.replace(platform, triton=True))
        layer = FusedMoE(*args, **kwargs).to(DEVICE)
    assert layer.forward_method == layer.forward_triton
    return layer


@pytest.mark.parametrize("num_shared,gated", [(1, True), (2, True), (2, False)])
def test_a_shared_expert_absorbed_as_experts_computes_what_it_did_apart(
    monkeypatch: pytest.MonkeyPatch, num_shared: int, gated: bool
) -> None:
    """A shared SwiGLU expert of num_shared x the experts' width, cut into num_shared experts that
    every token takes: the layer's output equals the routed sum plus the shared expert computed
    apart (times sigmoid(gate), whose logit is then the router's last column), on the Triton path
    and on the torch path of the same absorbed weights."""
    e, k, hidden, i = 16, 4, 64, 32
    x, w13, w2, logits, _, gate = _experts_inputs(29, e, k, hidden, i, seed=9)
    gen = torch.Generator().manual_seed(10)
    shared_gate_up = (torch.randn(2 * num_shared * i, hidden, generator=gen) / hidden**0.5).to(DEVICE)
    shared_down = (torch.randn(hidden, num_shared * i, generator=gen) / (num_shared * i) ** 0.5).to(DEVICE)
    g, u = (x @ shared_gate_up.T).chunk(2, dim=-1)
    shared = (torch.nn.functional.silu(g) * u) @ shared_down.T
    routed = fused_experts_torch(x, w13, w2, *select_experts(logits, k, renormalize=True))
    expected = routed + (torch.sigmoid(gate) * shared if gated else shared)

    layer = _triton_experts(monkeypatch, e, k, hidden, i, renormalize=True)
    layer.gate_up_proj.data.copy_(w13)
    layer.down_proj.data.copy_(w2)
    assert layer.can_absorb_shared_expert(num_shared * i) and not layer.can_absorb_shared_expert(i + 8)
    layer.absorb_shared_expert(shared_gate_up, shared_down, gate_in_logits=gated)
    assert layer.gate_up_proj.shape == (e + num_shared, 2 * i, hidden)
    assert layer.down_proj.shape == (e + num_shared, hidden, i)
    router_logits = torch.cat([logits, gate], dim=1) if gated else logits
    torch.testing.assert_close(layer(x, router_logits), expected, atol=3e-5, rtol=3e-5)
    layer.route, layer.forward_method = layer.route_torch, layer.forward_torch
    torch.testing.assert_close(layer(x, router_logits), expected, atol=3e-5, rtol=3e-5)


def test_absorbing_refuses_a_shared_expert_of_another_width(monkeypatch: pytest.MonkeyPatch) -> None:
    layer = _triton_experts(monkeypatch, 4, 2, 16, 8, renormalize=True)
    with pytest.raises(ValueError, match=r"width 12 .* cannot run as experts of width 8"):
        layer.absorb_shared_expert(
            torch.zeros(24, 16, device=DEVICE), torch.zeros(16, 12, device=DEVICE), True
        )


def test_qwen3_next_block_absorbs_its_shared_expert_where_the_grouped_gemm_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Qwen3-Next's sparse block after loading: on a Triton platform its shared expert (width 48,
    three experts of 16) and its gate join the experts and the router (one GEMM of E + 1 rows,
    padded to 16),
    the block's output unchanged; on the CPU's torch path it stays apart (Hugging Face's rounding)."""
    from transformers import Qwen3NextConfig

    from pagedllm.layers import custom_op
    from pagedllm.models.qwen3_next import Qwen3NextSparseMoeBlock

    config = Qwen3NextConfig(
        hidden_size=64, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(23, 64, generator=gen).to(DEVICE)

    def block() -> Qwen3NextSparseMoeBlock:
        module = Qwen3NextSparseMoeBlock(config).to(DEVICE)
        params = torch.Generator().manual_seed(12)
        for param in module.parameters():
            param.data.copy_(torch.randn(param.shape, generator=params) / 8)
        return module

    apart = block()
    apart.process_weights_after_loading()  # the CPU's torch path: nothing absorbed
    assert apart.shared_expert is not None and apart.experts.num_shared_slots == 0
    platform = custom_op.platform_for(torch.device(DEVICE))
    monkeypatch.setattr(custom_op, "platform_for", lambda device: dataclasses.replace(platform, triton=True))
    absorbed = block()
    with torch.no_grad():
        expected = absorbed(x)
        absorbed.process_weights_after_loading()
        assert absorbed.shared_expert is None and absorbed.shared_expert_gate is None
        assert absorbed.experts.num_shared_slots == 3 and absorbed.gate.weight.shape == (16, 64)
        torch.testing.assert_close(absorbed(x), expected, atol=3e-5, rtol=3e-5)
        torch.testing.assert_close(apart(x), expected, atol=3e-5, rtol=3e-5)
