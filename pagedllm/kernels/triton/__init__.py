"""Triton kernels: the ``triton`` attention backend's (DESIGN.md section 5), and the fused layer
kernels (``rms_norm``, ``rotary``, ``activation``) that the layers run on CUDA.

The attention kernels read and write the backend's cache layout: key_cache and value_cache are each
``[num_blocks, num_kv_heads, block_size, head_size]`` (see ``triton_backend.py`` for why).
Importing this package imports triton; set ``TRITON_INTERPRET=1`` before that to run the kernels on
the CPU.
"""

from pagedllm.kernels.triton.paged_decode import paged_decode
from pagedllm.kernels.triton.paged_prefill import paged_prefill
from pagedllm.kernels.triton.reshape_and_cache import reshape_and_cache

__all__ = ["paged_decode", "paged_prefill", "reshape_and_cache"]
