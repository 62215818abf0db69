"""Each tensor-parallel rank reads only its shard: a CheckpointSlice reads the region its weight
loader narrowed it to, from safetensors and from GGUF, and the region holds the same numbers as
the whole tensor read and then cut."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from pagedllm.layers.utils import CheckpointSlice, copy_weight
from pagedllm.model_loader.gguf_loader import iterate_gguf_weights, load_gguf_config
from pagedllm.model_loader.hf_loader import iterate_safetensors_weights


def test_a_slice_reads_only_the_composed_region():
    tensor = torch.arange(6 * 8, dtype=torch.float32).reshape(6, 8)
    reads: list[tuple[slice, ...]] = []

    def read_region(region: tuple[slice, ...]) -> torch.Tensor:
        reads.append(region)
        return tensor[region]

    whole = CheckpointSlice(tuple(tensor.shape), read_region)
    _, middle, _ = whole.split([1, 3, 2], dim=0)  # rows 1..3
    shard = middle.narrow(1, 4, 4).narrow(0, 1, 2)  # rows 2..3, columns 4..7
    assert shard.shape == (2, 4) and not reads
    destination = torch.empty(2, 4)
    copy_weight(destination, shard)
    assert reads == [(slice(2, 4), slice(4, 8))]
    assert torch.equal(destination, tensor[2:4, 4:8])
    with pytest.raises(ValueError, match="cannot narrow dim 1"):
        whole.narrow(1, 6, 4)


def test_safetensors_slices_read_the_rows_and_columns_asked_for(tmp_path: Path):
    weights = {"a.weight": torch.randn(8, 12), "a.bias": torch.randn(8)}
    save_file(weights, str(tmp_path / "model.safetensors"))
    for name, checkpoint_slice in iterate_safetensors_weights(str(tmp_path)):
        assert checkpoint_slice.shape == weights[name].shape
        assert torch.equal(checkpoint_slice.narrow(0, 2, 4).read(), weights[name][2:6])
        if name == "a.weight":
            assert torch.equal(checkpoint_slice.narrow(1, 6, 6).read(), weights[name][:, 6:])


def test_gguf_slices_dequantize_to_the_rows_of_the_whole_tensor(smollm2_gguf: str):
    """Quantized rows (Q4_1 blocks) and llama.cpp's permuted q/k rows, shard by shard."""
    from pagedllm.attention.backends.torch_backend import TorchAttentionBackend
    from pagedllm.models import get_model_class

    config = load_gguf_config(smollm2_gguf)
    with torch.device("meta"):
        model = get_model_class(config.architectures)(config, TorchAttentionBackend)
    head_size = config.hidden_size // config.num_attention_heads
    wanted = {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
              "model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.gate_proj.weight"}  # fmt: skip
    seen = set()
    for name, checkpoint_slice in iterate_gguf_weights(smollm2_gguf, model, config, torch.float32):
        if name not in wanted:
            continue
        seen.add(name)
        whole = checkpoint_slice.read()
        assert whole.shape == checkpoint_slice.shape
        # The second of three shards along the rows, and along the columns.
        rows, columns = whole.shape[0] // 3, whole.shape[1] // 3
        assert rows % head_size == 0 or "mlp" in name or "o_proj" in name
        assert torch.equal(checkpoint_slice.narrow(0, rows, rows).read(), whole[rows : 2 * rows])
        assert torch.equal(
            checkpoint_slice.narrow(1, columns, columns).read(), whole[:, columns : 2 * columns]
        )
    assert seen == wanted
