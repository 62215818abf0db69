"""Programmatic dependent launch is a GPU launch option: off on the CPU, where the kernels run
under Triton's interpreter (which has no ``griddepcontrol``)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="needs the triton package")

from pagedllm.kernels.triton.pdl import pdl_options


def test_pdl_is_off_on_the_cpu() -> None:
    assert pdl_options(torch.device("cpu")) == {"USE_GDC": False, "launch_pdl": False}
