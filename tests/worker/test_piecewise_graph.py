"""``cudagraph_mode="FULL_AND_PIECEWISE"`` without a GPU: which configurations may replay steps with
prompt tokens from graphs cut at the attention calls, the sizes their tokens are padded to, the
metadata the capture's eager attention runs under, and the bad values refused. The chains
themselves are captured and checked on a GPU (tests/gpu/test_piecewise_graphs_gpu.py)."""

from __future__ import annotations

import argparse
import logging
import os

import pytest
import torch

from pagedllm.attention.backends.torch_backend import TorchAttentionBackend
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.worker.piecewise_graph import (
    MAX_PIECEWISE_TOKENS,
    piecewise_capture_sizes,
    piecewise_sizes_for,
    stand_in_metadata,
)

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "configs")
PIECEWISE = {"load_format": "dummy", "device": "cpu", "cudagraph_mode": "FULL_AND_PIECEWISE"}


def _config(model: str, **overrides):
    return EngineArgs(model=os.path.join(CONFIGS, model), **{**PIECEWISE, **overrides}).create_engine_config()


@pytest.mark.parametrize(
    ("max_num_batched_tokens", "sizes"),
    [
        (16384, [16, 32, 64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048]),
        (2048, [16, 32, 64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048]),
        (1000, [16, 32, 64, 128, 192, 256, 384, 512, 768, 1000]),
        (100, [16, 32, 64, 100]),
        (8, [8]),
    ],
)
def test_capture_sizes_cover_every_step_up_to_the_limit(max_num_batched_tokens, sizes):
    assert piecewise_capture_sizes(max_num_batched_tokens) == sizes
    covered = min(max_num_batched_tokens, MAX_PIECEWISE_TOKENS)
    # Padding at most doubles a small step's tokens and adds at most half to one past 128 tokens.
    for num_tokens in range(1, covered + 1):
        padded = min(s for s in sizes if s >= num_tokens)
        assert padded <= max(16, 2 * num_tokens) and (num_tokens <= 128 or padded < 1.5 * num_tokens)


def test_a_plain_model_gets_chains_and_the_default_mode_gets_none():
    chunked = {"max_model_len": 1280, "enable_chunked_prefill": True}
    assert piecewise_sizes_for(_config("qwen3-0.6b", max_num_batched_tokens=4096, **chunked))[-1] == 2048
    assert piecewise_sizes_for(_config("qwen3-30b-a3b", max_num_batched_tokens=512, **chunked))[-1] == 512
    assert piecewise_sizes_for(_config("qwen3-0.6b", cudagraph_mode="FULL_DECODE_ONLY")) == []
    assert piecewise_sizes_for(_config("qwen3-0.6b", enforce_eager=True)) == []


@pytest.mark.parametrize(
    ("model", "overrides", "reason"),
    [
        ("qwen3-next-2b", {}, "its recurrent layers read the step's metadata"),
        ("deepseek-v2-lite", {}, "multi-head latent attention attends outside the Attention layer"),
        ("qwen3-0.6b", {"tensor_parallel_size": 2}, "tensor_parallel_size > 1"),
        ("qwen3-0.6b", {"pipeline_parallel_size": 2}, "pipeline_parallel_size > 1"),
        ("qwen3-0.6b", {"enable_lora": True}, "enable_lora"),
        (
            "llama-3.1-8b",
            {
                "speculative_config": {
                    "method": "eagle3",
                    "model": os.path.join(CONFIGS, "llama-3.1-8b-eagle3"),
                    "num_speculative_tokens": 3,
                }
            },
            "a drafter that reads hidden states",
        ),
    ],
)
def test_models_the_chains_cannot_follow_run_their_prompt_steps_eagerly(model, overrides, reason, caplog):
    config = _config(model, **overrides)
    with caplog.at_level(logging.WARNING, logger="pagedllm.worker.piecewise_graph"):
        assert piecewise_sizes_for(config) == []
    # Only this module's records: transformers may warn about the shrunken test config too.
    assert [r.getMessage() for r in caplog.records if r.name == "pagedllm.worker.piecewise_graph"] == [
        f"cudagraph_mode FULL_AND_PIECEWISE: steps with prompt tokens run eagerly ({reason})"
    ]


def test_a_bad_mode_is_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"cudagraph_mode.*FULL_AND_PIECEWISE.*got 'PIECEWISE_PLEASE'"):
        _config("qwen3-0.6b", cudagraph_mode="PIECEWISE_PLEASE")
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--model", "m", "--cudagraph-mode", "FULL_AND_PIECEWISE"])
    assert EngineArgs.from_cli_args(args).cudagraph_mode == "FULL_AND_PIECEWISE"


@pytest.mark.parametrize(("size", "max_model_len", "lengths"), [(40, 16, [16, 16, 8]), (64, 1280, [64])])
def test_the_captures_attention_writes_nothing_and_reads_block_zero(size, max_model_len, lengths):
    metadata = stand_in_metadata(size, max_model_len, 16, torch.device("cpu"))
    assert metadata.seq_lens_cpu.tolist() == lengths
    assert metadata.query_start_loc_cpu.tolist() == [0, *torch.tensor(lengths).cumsum(0).tolist()]
    assert (metadata.slot_mapping == -1).all() and metadata.slot_mapping.numel() == size
    assert metadata.block_tables.shape == (len(lengths), -(-max(lengths) // 16))
    assert not metadata.block_tables.any()
    # An attention backend runs under it, and leaves the cache as it was.
    backend = TorchAttentionBackend(4, 16, 0.25, 2)
    cache = (torch.randn(2, 16, 2, 16), torch.randn(2, 16, 2, 16))  # [blocks, block_size, kv heads, head]
    before = [c.clone() for c in cache]
    q, k, v = torch.randn(size, 4, 16), torch.randn(size, 2, 16), torch.randn(size, 2, 16)
    out = backend.forward(q, k, v, cache, metadata)
    assert out.shape == (size, 4, 16) and torch.isfinite(out).all()
    assert all(torch.equal(a, b) for a, b in zip(cache, before))
