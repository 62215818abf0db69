"""Impossible tensor-parallel configurations are refused with a ValueError naming the argument and
what would work, before any process starts or any weight is read."""

from __future__ import annotations

import argparse

import pytest
import torch
from transformers import LlamaConfig

from pagedllm.engine.arg_utils import EngineArgs


@pytest.fixture(scope="module")
def model_dir(make_tiny_model_once) -> str:
    # 4 heads, 2 KV heads, intermediate_size 96: 1, 2 and 4 ranks shard it; 3 does not.
    return make_tiny_model_once(LlamaConfig, num_attention_heads=4, num_key_value_heads=2)[1].model


def config_of(model_dir: str, **kwargs):
    return EngineArgs(model=model_dir, device=kwargs.pop("device", "cpu"), **kwargs).create_engine_config()


def test_a_size_that_does_not_split_the_heads_is_refused_with_the_sizes_that_do(model_dir):
    with pytest.raises(ValueError, match=r"tensor_parallel_size must split .* one of \[1, 2, 4\], got 3"):
        config_of(model_dir, tensor_parallel_size=3)


def test_more_ranks_than_kv_heads_replicate_them(model_dir):
    config = config_of(model_dir, tensor_parallel_size=4)
    assert config.model_config.num_kv_heads_per_rank(4) == 1


def test_the_backend_defaults_to_in_process_for_one_rank_and_processes_for_more(model_dir):
    assert config_of(model_dir).parallel_config.distributed_executor_backend == "uni"
    assert config_of(model_dir, tensor_parallel_size=2).parallel_config.distributed_executor_backend == "mp"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"tensor_parallel_size": 0}, "tensor_parallel_size must be an int >= 1"),
        (
            {"tensor_parallel_size": 2, "distributed_executor_backend": "uni"},
            "tensor_parallel_size must be 1 with",
        ),
        ({"distributed_executor_backend": "threads"}, r"distributed_executor_backend must be one of \('uni'"),
        ({"tensor_parallel_size": 2, "device": "cuda:1"}, "device must be 'auto', 'cpu' or 'cuda' with"),
    ],
)
def test_bad_arguments_name_the_field(model_dir, kwargs, match):
    with pytest.raises(ValueError, match=match):
        config_of(model_dir, **kwargs)


@pytest.mark.skipif(torch.cuda.device_count() >= 64, reason="needs fewer than 64 visible GPUs")
def test_more_ranks_than_visible_gpus_are_refused(model_dir):
    # The devices are counted before the model is read.
    with pytest.raises(ValueError, match=r"tensor_parallel_size must be <= the \d+ visible CUDA devices"):
        EngineArgs(model=model_dir, device="cuda", tensor_parallel_size=64).create_engine_config()


def test_the_cli_flags_reach_the_engine_arguments():
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--tensor-parallel-size", "2", "--distributed-executor-backend", "ray"])
    engine_args = EngineArgs.from_cli_args(args)
    assert (engine_args.tensor_parallel_size, engine_args.distributed_executor_backend) == (2, "ray")
