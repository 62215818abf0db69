"""Every Triton kernel launch the wrappers make compiles for Hopper (sm_90), checked on the CPU.

Triton's interpreter (which runs the kernel tests without a GPU) executes kernels as Python, so it
accepts what the compiler refuses: a loop-carried variable that changes type, a constexpr misused,
shared memory or registers past the device's limits. ``sm90_compile.py`` calls the kernel
wrappers on small CPU tensors with the launches replaced by compiles for sm_90 (ptxas included),
in a process of its own because this one's kernels are interpreted.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="needs the triton package")

SCRIPT = Path(__file__).with_name("sm90_compile.py")


@pytest.mark.slow
def test_every_kernel_launch_compiles_for_sm90() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    # Each kernel family was reached (a wrapper that stopped launching would drop out silently).
    for kernel in (
        "_paged_decode_kernel",
        "_paged_decode_reduce_kernel",
        "_mla_decode_kernel",
        "_mla_merge_kernel",
        "_paged_prefill_kernel",
        "_reshape_and_cache_kernel",
        "_moe_gemm_kernel",
        "_moe_count_kernel",
        "_moe_offsets_kernel",
        "_moe_place_kernel",
        "_moe_align_one_program_kernel",
        "_moe_sum_kernel",
        "_topk_softmax_kernel",
        "_rms_norm_kernel",
        "_rotary_kernel",
        "_silu_and_mul_kernel",
        "_sigmoid_gate_kernel",
        "_partials_kernel",
        "_merge_kernel",
        "_apply_bitmask_kernel",
        "_lora_shrink_kernel",
        "_lora_expand_kernel",
        "_sgmv_shrink_kernel",
        "_sgmv_expand_kernel",
        "_matmul_kernel",
        "_skinny_kernel",
        "_w4a16_dequantize_kernel",
        "_fp8_block_kernel",
        "_fp8_quant_kernel",
        "_conv1d_update_kernel",
        "_conv1d_varlen_kernel",
        "_gated_delta_rule_update_kernel",
        "_rms_norm_gated_kernel",
        "_l2_normalize_kernel",
        "_gather_state_rows_kernel",
        "_scatter_state_rows_kernel",
    ):
        assert f"compiled {kernel} " in result.stdout, kernel
