"""Timing variants of the engine, for leave-one-out measurements: put this folder first on
PYTHONPATH and name a variant in ``PAGEDLLM_BENCH_VARIANT``; every Python process started so (the
tensor-parallel ranks too, which a spawned rank would not inherit from a patched parent) runs it.

    PAGEDLLM_BENCH_VARIANT=no-all-reduce PYTHONPATH=benchmarks/variants:. \
        python3 -m pagedllm bench latency --skip-eager --tensor-parallel-size 2

Variants (timing only: the ones that leave work out produce wrong tokens, and say so on stderr):
- ``separate-cache-write``: decode-only steps write the KV cache with ``reshape_and_cache`` before
  the decode kernel, as every step did before ``kernels/triton/decode_append.py``: the append's
  before, in the same call as its after.
- ``no-decode-attention``: the Triton decode kernel (and in decode-only steps the cache write it
  does) left out.
- ``no-all-reduce``: every tensor-parallel all-reduce left out (ranks keep their partial sums).
- ``decode-partitions-N``: every decode launch cut into partitions of N tokens.

An interpreter with the variable unset or empty imports nothing from pagedllm here.
"""

import os
import sys

_variant = os.environ.get("PAGEDLLM_BENCH_VARIANT", "")
if _variant:
    import pagedllm.attention.backends.triton_backend as _triton_backend
    import pagedllm.distributed as _distributed
    import pagedllm.distributed.parallel_state as _parallel_state

    if _variant == "separate-cache-write":
        _triton_backend.TritonAttentionBackend.appends_in_decode = False
    elif _variant == "no-decode-attention":
        _triton_backend.paged_decode = lambda *args, **kwargs: None
    elif _variant == "no-all-reduce":
        _distributed.tensor_model_parallel_all_reduce = lambda x: x
        _parallel_state.tensor_model_parallel_all_reduce = lambda x: x
        # The fused all-reduce + norm reads the communicator: without one, the norm's own path.
        _parallel_state.get_symm_mem_all_reduce = lambda: None
        _distributed.get_symm_mem_all_reduce = lambda: None
    elif _variant.startswith("decode-partitions-"):
        _size = int(_variant.removeprefix("decode-partitions-"))
        _triton_backend.decode_partition_size = lambda *args, **kwargs: _size
    else:
        print(f"PAGEDLLM_BENCH_VARIANT={_variant!r}: no such variant (benchmarks/variants)", file=sys.stderr)
        os._exit(2)
    if _variant.startswith("no-"):
        print(f"[variant {_variant}: timing only, the outputs are wrong]", file=sys.stderr)
