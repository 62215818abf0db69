import gc

import pytest
import torch


@pytest.fixture(autouse=True)
def release_gpu_memory():
    """Each engine sizes its KV cache from the memory free when it starts: let none outlive its
    test."""
    yield
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
