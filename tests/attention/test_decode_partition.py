"""How the Triton decode launch splits decode contexts into partitions, per batch and GPU size (the
kernels themselves are tested in tests/kernels)."""

from __future__ import annotations

import pytest
import torch

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


def test_off_cuda_the_launch_partition_stands() -> None:
    assert decode_partition_size(1, 8, 8192, LAUNCH, torch.device("cpu")) == 1024
