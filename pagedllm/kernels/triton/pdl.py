"""Programmatic dependent launch (PDL, Hopper and later): a kernel launched with it may be
scheduled while the kernel before it in the stream is still running, and waits on the device
(``griddepcontrol.wait``) for that kernel to finish and flush its writes before its own first
load or store. What overlaps is the launch: block scheduling and the prologue up to the wait. A
one-token decode step is a chain of a dozen small kernels per layer (W3: ~380 a token), where each
boundary costs a launch latency that the GPU otherwise idles through.

Every kernel launched with ``launch_pdl`` must call ``wait_for_prior_kernel`` before it touches
memory: the wait also covers the previous kernel's reads of what this one overwrites (the fused
RMSNorm writes its input in place). After the wait, the kernel lets its own dependents be
scheduled (``griddepcontrol.launch_dependents``): they wait for this kernel's completion in turn.
A kernel launched without the option (cuBLAS's) runs in plain stream order, after its
predecessor completes, as before.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.platform import platform_for


def pdl_options(device: torch.device) -> dict[str, bool]:
    """A launch's PDL keyword arguments on ``device``: the kernel's ``USE_GDC`` switch and the
    launch option, both on where the device has PDL (not on the CPU, where the kernels run under
    Triton's interpreter, which has no ``griddepcontrol``)."""
    on = platform_for(device).supports_pdl
    return {"USE_GDC": on, "launch_pdl": on}


@triton.jit
def wait_for_prior_kernel(USE_GDC: tl.constexpr):
    """The first statement of a kernel launched with ``pdl_options``: wait until the previous
    kernel in the stream has completed and its writes are visible, then let the next one be
    scheduled (it waits for this one the same way)."""
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
