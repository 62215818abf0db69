"""How the Triton decode launch splits decode contexts into partitions, per batch and GPU size (the
kernels themselves are tested in tests/kernels)."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.attention.backends.torch_backend import TorchAttentionBackend
from pagedllm.kernels.triton import launch
from pagedllm.kernels.triton.launch import decode_partition_size

LAUNCH = {"partition_size": 1024, "block_n": 64}
CUDA = torch.device("cuda")  # a device object only: nothing runs on it


@pytest.fixture
def sms(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launch, "_num_sms", lambda device: 132)


def test_a_batch_that_fills_the_gpu_gets_one_partition(sms) -> None:
    # 256 sequences x 8 KV heads = 2,048 programs on 132 SMs: no split, no reduce pass.
    assert decode_partition_size(256, 8, 1280, LAUNCH, CUDA) == 1280
    # Rounded up to whole tiles, and never below the launch's partition.
    assert decode_partition_size(256, 8, 1300, LAUNCH, CUDA) == 1344
    assert decode_partition_size(256, 8, 100, LAUNCH, CUDA) == 1024
    assert decode_partition_size(132, 8, 40960, LAUNCH, CUDA) == 40960


def test_a_small_batch_is_split_until_every_sm_has_two_programs(sms) -> None:
    # One sequence, 8 KV heads: 8 programs per partition; 264 programs need 33 partitions.
    assert decode_partition_size(1, 8, 2048, LAUNCH, CUDA) == 64
    assert decode_partition_size(1, 8, 8192, LAUNCH, CUDA) == 128
    # Just under the unsplit threshold (8 pairs per SM): 1,024-token partitions already give
    # every SM two programs.
    assert decode_partition_size(131, 8, 4096, LAUNCH, CUDA) == 1024
    # 128 pairs: two partitions give 256 programs, short of 264; four give 512.
    assert decode_partition_size(16, 8, 1024, LAUNCH, CUDA) == 256


def test_equal_contexts_that_spread_evenly_stay_unsplit(sms) -> None:
    # K1: 64 sequences x 8 KV heads = 512 pairs, 3.88 per SM: the fullest SM runs 4, a 3% loss.
    assert decode_partition_size(64, 8, 4096, LAUNCH, CUDA, min_seq_len=4096) == 4096
    assert decode_partition_size(64, 8, 16384, LAUNCH, CUDA, min_seq_len=15000) == 16384
    # Unequal (ragged) or unknown lengths: split to balance, as before.
    assert decode_partition_size(64, 8, 8192, LAUNCH, CUDA, min_seq_len=1) == 1024
    assert decode_partition_size(64, 8, 4096, LAUNCH, CUDA) == 1024
    # 400 pairs (3.03 per SM): unsplit, the fullest SM would run 4 where 3.03 is even, 32% lost.
    assert decode_partition_size(50, 8, 4096, LAUNCH, CUDA, min_seq_len=4096) == 1024
    # Fewer than two programs per SM: split to fill the GPU.
    assert decode_partition_size(16, 8, 4096, LAUNCH, CUDA, min_seq_len=4096) == 1024


def test_off_cuda_the_launch_partition_stands() -> None:
    assert decode_partition_size(1, 8, 8192, LAUNCH, torch.device("cpu")) == 1024


def test_each_step_tells_the_backends_its_shortest_decode_context(
    tiny_llama_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rule above reads ``min_decode_seq_len`` from the step's metadata: the shortest context
    among the decodes (prompts of different lengths, some still in prefill beside them)."""
    seen = []
    forward = TorchAttentionBackend.forward

    def recording_forward(self, query, key, value, kv_cache, attn_metadata, *args, **kwargs):
        md = attn_metadata
        seen.append((md.num_decodes, md.min_decode_seq_len, md.seq_lens_cpu[: md.num_decodes].tolist()))
        return forward(self, query, key, value, kv_cache, attn_metadata, *args, **kwargs)

    monkeypatch.setattr(TorchAttentionBackend, "forward", recording_forward)
    llm = LLM(
        tiny_llama_dir,
        device="cpu",
        attention_backend="torch",
        max_num_batched_tokens=64,
        max_num_seqs=8,
        enable_chunked_prefill=True,
    )
    prompts = [[5 + i] * n for i, n in enumerate((3, 40, 17, 90))]
    llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=6, ignore_eos=True))
    decode_steps = [(low, lens) for num_decodes, low, lens in seen if num_decodes]
    assert decode_steps and any(len(set(lens)) > 1 for _, lens in decode_steps)
    assert all(low == min(lens) for low, lens in decode_steps)
    assert all(low == 0 for num_decodes, low, _ in seen if not num_decodes)
