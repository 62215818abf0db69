"""Run the Triton kernels in Triton's interpreter when there is no GPU.

Triton reads TRITON_INTERPRET when it decorates a kernel, its own standard library (``tl.zeros``,
``tl.max``, ...) included, i.e. when ``triton`` is first imported. The variable is set here only
without CUDA: on a GPU machine these tests (and tests/gpu) compile for the device.

If something imported triton before this file ran (tests/conftest.py importing transformers or
torch._dynamo does), it is too late: the kernels would mix interpreted and compiled functions.
The tests here are then skipped with that reason; set TRITON_INTERPRET=1 in the environment, or
before the first import in tests/conftest.py, to run them.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

TRITON_IMPORTED_TOO_EARLY = False
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    TRITON_IMPORTED_TOO_EARLY = "triton" in sys.modules
    os.environ["TRITON_INTERPRET"] = "1"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not TRITON_IMPORTED_TOO_EARLY:
        return
    skip = pytest.mark.skip(
        reason="triton was imported before TRITON_INTERPRET=1 was set; export it to run these on the CPU"
    )
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.path).startswith(here):
            item.add_marker(skip)
