"""The batched LoRA product (pagedllm/lora/punica.py) against the per-token formula it stands for,
``y[t] += (x[t] @ A[s(t)]^T) @ B[s(t)]^T``, computed one token at a time; and the per-token
adapter ids of a step; the kernels' warm-up when a model is wrapped."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.lora.punica import NO_SLOT, LoRABatch, token_lora_ids


def test_token_lora_ids_repeat_each_request_over_its_tokens():
    ids = token_lora_ids(np.array([0, 3, 5]), np.array([0, 2, 3, 7]), pad_to=0)
    assert ids.tolist() == [0, 0, 3, 5, 5, 5, 5]


def test_token_lora_ids_pad_a_graph_batch_without_adapter():
    ids = token_lora_ids(np.array([4, 2]), np.arange(9), pad_to=8)
    assert ids.tolist() == [4, 2, 0, 0, 0, 0, 0, 0]


@pytest.mark.parametrize("num_slices", [1, 3])
def test_stacked_masked_product_equals_each_tokens_own_adapter(num_slices):
    num_slots, rank, in_features, out_per_slice, num_tokens = 3, 4, 16, 8, 9
    generator = torch.Generator().manual_seed(0)
    # Each slot's adapter: per slice, A [r, in] and B [out_slice, r] with r <= rank (zero-padded).
    ranks = [4, 2, 3]
    adapters = [
        [
            (
                torch.randn(r, in_features, generator=generator),
                torch.randn(out_per_slice, r, generator=generator),
            )
            for _ in range(num_slices)
        ]
        for r in ranks
    ]
    width = num_slices * num_slots * rank
    lora_a = torch.zeros(width, in_features)
    lora_b = torch.zeros(num_slices * out_per_slice, width)
    for slot, slices in enumerate(adapters):
        for i, (a, b) in enumerate(slices):
            start = (i * num_slots + slot) * rank
            lora_a[start : start + a.shape[0]] = a
            lora_b[i * out_per_slice : (i + 1) * out_per_slice, start : start + a.shape[0]] = b
    batch = LoRABatch(num_slots, rank, 16, {num_slices}, torch.float32, torch.device("cpu"))
    slots = np.array([NO_SLOT, 0, 2, 2, 1, NO_SLOT, 0, 1, 2])
    batch.set_token_slots(slots)
    x = torch.randn(num_tokens, in_features, generator=generator)
    y = torch.randn(num_tokens, num_slices * out_per_slice, generator=generator)
    expected = y.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot == NO_SLOT:
            continue
        for i, (a, b) in enumerate(adapters[slot]):
            expected[t, i * out_per_slice : (i + 1) * out_per_slice] += b @ (a @ x[t])
    batch.apply(y, x, lora_a, lora_b, num_slices, (0, 0))  # slice starts: the kernels' only
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
    # Tokens without an adapter are left exactly as they were.
    assert torch.equal(y[slots == NO_SLOT], expected[slots == NO_SLOT])


def test_the_manager_warms_up_each_distinct_projection_once_at_load(make_tiny_model, monkeypatch):
    """With the kernels, wrapping a model compiles SGMV's variants for q/k/v, o, gate/up and down
    (every layer's projection of a kind is the same shape): once each, on the wrapper's own slot
    buffers."""
    import functools

    from transformers import LlamaConfig

    from pagedllm.attention.backends.torch_backend import TorchAttentionBackend
    from pagedllm.kernels.triton import lora_sgmv
    from pagedllm.lora import model_manager
    from pagedllm.lora.config import LoRAConfig
    from pagedllm.model_loader import get_model

    _, model_config = make_tiny_model(LlamaConfig, num_attention_heads=4, num_key_value_heads=2)
    model = get_model(model_config, "auto", torch.device("cpu"), TorchAttentionBackend)
    calls = []
    monkeypatch.setattr(lora_sgmv, "warm_up", lambda lora_a, lora_b, *args: calls.append((lora_a, args)))
    monkeypatch.setattr(model_manager, "LoRABatch", functools.partial(LoRABatch, use_kernels=True))
    config = LoRAConfig(max_loras=2, max_lora_rank=8)
    manager = model_manager.LoRAModelManager(model, config, model_config.hf_config, 16, torch.device("cpu"))
    assert model_config.hf_config.num_hidden_layers > 1
    assert len(manager.wrappers) == 4 * model_config.hf_config.num_hidden_layers
    first_layer = manager.wrappers[:4]  # q/k/v, o, gate/up, down of layer 0, in model order
    assert len(calls) == 4 and all(lora_a is w.lora_a for (lora_a, _), w in zip(calls, first_layer))
    assert [args for _, args in calls] == [(2, 8, w.slice_starts) for w in first_layer]
