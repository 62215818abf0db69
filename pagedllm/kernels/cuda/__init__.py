"""CUDA C++ kernels for the ``cuda`` attention backend (DESIGN.md section 5): vLLM's original
PagedAttention V1 and V2 and their cache write, over vLLM's original cache layout (``layout.py``).

Sources are in ``csrc/`` (one .cu file per kernel family, plain C++ launchers in ``ops.h``, the
torch binding in ``binding.cpp``); ``build.load`` compiles them on first use. Importing this
package builds nothing and needs no GPU.
"""

from pagedllm.kernels.cuda.ops import (
    paged_attention,
    paged_attention_v1,
    paged_attention_v2,
    reshape_and_cache,
    use_v1,
)

__all__ = ["paged_attention", "paged_attention_v1", "paged_attention_v2", "reshape_and_cache", "use_v1"]
