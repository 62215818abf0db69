"""CPU defaults: bf16 where the CPU has bf16 units, threads from the physical cores."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import PretrainedConfig

from pagedllm import config as config_module
from pagedllm.config import DeviceConfig, resolve_dtype
from pagedllm.cpu_info import physical_cpu_cores

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    "has_bf16, checkpoint, expected",
    [
        (True, None, torch.bfloat16),  # a GGUF: no checkpoint dtype
        (True, "bfloat16", torch.bfloat16),
        (True, "float16", torch.bfloat16),
        (True, "float32", torch.float32),  # the checkpoint's own precision
        (False, None, torch.float32),
        (False, "bfloat16", torch.float32),
    ],
)
def test_auto_dtype_on_the_cpu(
    monkeypatch: pytest.MonkeyPatch, has_bf16: bool, checkpoint: str | None, expected: torch.dtype
) -> None:
    monkeypatch.setattr(config_module, "cpu_has_bf16", lambda: has_bf16)
    hf_config = PretrainedConfig()
    hf_config.torch_dtype = checkpoint
    assert resolve_dtype("auto", hf_config, CPU) == expected
    assert resolve_dtype("float32", hf_config, CPU) == torch.float32  # an explicit dtype wins
    with pytest.raises(ValueError, match="dtype must be float32 or bfloat16 on the CPU"):
        resolve_dtype("float16", hf_config, CPU)


def test_threads_default_to_physical_cores_and_are_validated() -> None:
    from pagedllm.engine.arg_utils import EngineArgs

    assert 1 <= physical_cpu_cores() <= (os.cpu_count() or 1)
    args = EngineArgs(load_format="dummy", device="cpu")
    assert args.create_engine_config().device_config.num_threads == physical_cpu_cores()
    assert EngineArgs(device="cpu", threads=1).create_engine_config().device_config.num_threads == 1
    with pytest.raises(ValueError, match="threads must be None or >= 1"):
        DeviceConfig(device=CPU, num_threads=0)
