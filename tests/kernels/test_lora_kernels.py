"""The Triton BGMV shrink/expand (kernels/triton/lora.py) against the torch path's masked product
(lora/punica.py), the engine's reference, on tiny shapes: a fused projection of unequal slices
(q wider than k and v), ranks padded in their slots, tokens without adapter left untouched. On
the CPU the kernels run under TRITON_INTERPRET=1."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.kernels.triton.lora import lora_shrink_expand
from pagedllm.lora.punica import NO_SLOT, LoRABatch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def stacked_slots(slice_sizes, num_slots, rank, in_features, dtype, generator):
    """A [n*S*R, in] and B [out, n*S*R] as the LoRA layers stack them, each slot's adapter of a
    rank <= R (the rest zero)."""
    n = len(slice_sizes)
    lora_a = torch.zeros(n * num_slots * rank, in_features)
    lora_b = torch.zeros(sum(slice_sizes), n * num_slots * rank)
    for slot in range(num_slots):
        r = rank - slot % 2  # a padded rank in every other slot
        for i, size in enumerate(slice_sizes):
            start = (i * num_slots + slot) * rank
            lora_a[start : start + r] = torch.randn(r, in_features, generator=generator)
            row = sum(slice_sizes[:i])
            lora_b[row : row + size, start : start + r] = torch.randn(size, r, generator=generator)
    return lora_a.to(DEVICE, dtype), lora_b.to(DEVICE, dtype)


@pytest.mark.parametrize("num_tokens", [7, 20], ids=["narrow-expand", "wide-expand"])
@pytest.mark.parametrize(
    ("slice_sizes", "dtype"),
    [((24,), torch.float32), ((16, 8, 8), torch.float32), ((16, 8, 8), torch.bfloat16)],
)
def test_bgmv_equals_the_masked_product(slice_sizes, dtype, num_tokens):
    # in_features: three BLOCK_K chunks, the last one partial, so the shrink splits K three ways.
    num_slots, rank, in_features = 3, 4, 300
    generator = torch.Generator().manual_seed(0)
    lora_a, lora_b = stacked_slots(slice_sizes, num_slots, rank, in_features, dtype, generator)
    slots = np.resize([1, NO_SLOT, 0, 2, 2, NO_SLOT, 1], num_tokens)
    x = torch.randn(num_tokens, in_features, generator=generator).to(DEVICE, dtype)
    y = torch.randn(num_tokens, sum(slice_sizes), generator=generator).to(DEVICE, dtype)

    # The masked product in float32 (the torch path, whatever the device) is the reference.
    masked = LoRABatch(
        num_slots, rank, num_tokens, {len(slice_sizes)}, torch.float32, DEVICE, use_kernels=False
    )
    masked.set_token_slots(slots)
    starts = [sum(slice_sizes[: i + 1]) for i in range(len(slice_sizes) - 1)]
    starts += [sum(slice_sizes)] * (2 - len(starts))
    expected = y.float().clone()
    masked.apply(expected, x.float(), lora_a.float(), lora_b.float(), len(slice_sizes), tuple(starts))

    got = y.clone()
    token_slots = torch.from_numpy(slots).to(DEVICE)
    lora_shrink_expand(got, x, lora_a, lora_b, token_slots, num_slots, rank, tuple(starts))
    # float32: sums of 300 products of magnitude ~1 in another order than the torch product's.
    rtol, atol = (1e-5, 1e-4) if dtype == torch.float32 else (2e-2, 2e-2)
    torch.testing.assert_close(got.float(), expected, rtol=rtol, atol=atol)
    assert torch.equal(got[torch.from_numpy(slots == NO_SLOT)], y[torch.from_numpy(slots == NO_SLOT)])


def test_the_lora_layers_give_the_same_outputs_through_the_kernels():
    """LoRABatch's two products behind one wrapper, slice boundaries and slot buffer included."""
    from pagedllm.layers.linear import QKVParallelLinear
    from pagedllm.lora.layers import LinearWithLoRA

    generator = torch.Generator().manual_seed(1)
    base = QKVParallelLinear(32, 8, 4, 2, bias=False)  # q 32 rows, k and v 16 each
    base.weight.data = torch.randn(base.weight.shape, generator=generator)
    slots = np.array([0, NO_SLOT, 1, 1, 0])
    x = torch.randn(len(slots), 32, generator=generator)
    outputs = []
    for use_kernels in (False, True):
        batch = LoRABatch(2, 4, 8, {3}, torch.float32, torch.device("cpu"), use_kernels=use_kernels)
        layer = LinearWithLoRA(base, ("q", "k", "v"), batch)
        for slot, rank in ((0, 4), (1, 3)):
            g = torch.Generator().manual_seed(10 + slot)
            layer.set_slot(
                slot,
                [
                    (torch.randn(rank, 32, generator=g), torch.randn(size, rank, generator=g))
                    for size in (32, 16, 16)
                ],
            )
        batch.set_token_slots(slots)
        outputs.append(layer(x))
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(outputs[1][1], base(x)[1])
