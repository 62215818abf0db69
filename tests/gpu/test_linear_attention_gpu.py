"""Hybrid models on CUDA: the linear-attention decode kernels against the torch references at
Qwen3-Next's and Qwen3.5's shapes, and Qwen3-Next, Nemotron-H, Granite 4.0-H and Bamba end to end
in float32 (Triton kernels, CUDA graphs for decode steps, whose padding rows write the scratch
state row) against Hugging Face ``generate``. (Gated DeltaNet's Triton step, flash-linear-attention's
prefill included, against its torch step: tests/kernels/test_gated_deltanet_paths.py.)"""

from __future__ import annotations

import gc
import importlib.util
import os
from collections.abc import Callable

import pytest
import torch

if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("needs CUDA and compiled (not interpreted) Triton kernels", allow_module_level=True)
pytest.importorskip("triton")

from transformers import NemotronHConfig, Qwen3NextConfig

from pagedllm import LLM, SamplingParams
from pagedllm.kernels.triton.causal_conv1d import causal_conv1d_update
from pagedllm.kernels.triton.linear_attention import gated_delta_rule_update
from pagedllm.layers.linear_attention import conv1d
from pagedllm.layers.linear_attention.gated_delta_rule import gdn_gates, recurrent_gated_delta_rule
from tests.models.test_granite_hybrid import WIDE_CASES

pytestmark = pytest.mark.gpu

DEVICE = torch.device("cuda")
TOLERANCES = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


def _slots(batch: int, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct scattered rows (the last request on the scratch row -1) and every third request
    at its first token."""
    slots = torch.randperm(num_rows - 1, device=DEVICE)[:batch]
    slots[-1] = -1
    has_state = torch.arange(batch, device=DEVICE) % 3 != 1
    return slots, has_state


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [1, 7, 64, 256])
@pytest.mark.parametrize(
    ("num_k_heads", "num_v_heads", "d_k", "d_v"), [(16, 32, 128, 128), (4, 8, 128, 128), (2, 2, 64, 96)]
)
def test_decode_kernels_match_the_torch_references(dtype, batch, num_k_heads, num_v_heads, d_k, d_v) -> None:
    torch.manual_seed(0)
    conv_dim = 2 * num_k_heads * d_k + num_v_heads * d_v
    num_rows = batch + 9
    slots, has_state = _slots(batch, num_rows)
    x = torch.randn(batch, conv_dim, device=DEVICE, dtype=dtype)
    weight = torch.randn(conv_dim, 4, device=DEVICE, dtype=dtype)
    conv_state = torch.randn(num_rows, conv_dim, 3, device=DEVICE, dtype=dtype)
    expected, expected_window = conv1d.causal_conv1d_update(x, weight, None, conv_state[slots], has_state)
    out = causal_conv1d_update(x, weight, None, conv_state, slots, has_state)
    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])
    torch.testing.assert_close(conv_state[slots], expected_window.to(dtype), **TOLERANCES[dtype])

    q, k, v = out.split([num_k_heads * d_k, num_k_heads * d_k, num_v_heads * d_v], dim=-1)
    q, k, v = (
        q.view(batch, num_k_heads, d_k),
        k.view(batch, num_k_heads, d_k),
        v.view(batch, num_v_heads, d_v),
    )
    group = num_v_heads // num_k_heads
    b, a = torch.randn(batch, num_k_heads, 2 * group, device=DEVICE, dtype=dtype).split([group, group], -1)
    A_log, dt_bias = torch.randn(num_v_heads, device=DEVICE), torch.randn(num_v_heads, device=DEVICE)
    ssm_state = torch.randn(num_rows, num_v_heads, d_v, d_k, device=DEVICE, dtype=dtype)  # V-first
    start = torch.where(has_state[:, None, None, None], ssm_state[slots].float(), 0.0)
    g, beta = gdn_gates(a.flatten(1), b.flatten(1), A_log, dt_bias)
    expected_o, expected_s = recurrent_gated_delta_rule(q, k, v, g, beta, start.transpose(-1, -2))
    expected_s = expected_s.transpose(-1, -2)
    o = gated_delta_rule_update(q, k, v, a, b, A_log, dt_bias, ssm_state, slots, has_state)
    torch.testing.assert_close(o.float(), expected_o, **TOLERANCES[dtype])
    torch.testing.assert_close(ssm_state[slots].float(), expected_s.to(dtype).float(), **TOLERANCES[dtype])


QWEN3_NEXT = dict(
    vocab_size=256,
    hidden_size=256,
    intermediate_size=384,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=1024,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
    shared_expert_intermediate_size=96,
)
NEMOTRON_H = dict(
    vocab_size=256,
    hidden_size=256,
    num_hidden_layers=4,
    layers_block_type=["linear_attention", "mlp", "full_attention", "linear_attention"],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    mamba_num_heads=8,
    mamba_head_dim=32,
    n_groups=2,
    ssm_state_size=32,
    intermediate_size=384,
    chunk_size=32,
    max_position_embeddings=1024,
)
CASES = {
    "qwen3-next": lambda: Qwen3NextConfig(**QWEN3_NEXT),
    "nemotron-h": lambda: NemotronHConfig(**NEMOTRON_H),
    # Granite 4.0-H with experts and NoPE attention, and Bamba: the CPU tests' configs widened to
    # heads of 64, the Triton attention's smallest.
    "granite-4.0-h": WIDE_CASES["moe-nope"],
    "bamba": WIDE_CASES["bamba"],
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_greedy_on_cuda_matches_hf(case: str, enforce_eager: bool, make_hybrid_reference: Callable) -> None:
    # HF's reference runs on the CPU, in exact float32 (on CUDA, cuDNN may take TF32 for the
    # Mamba-2 layers' convolutions); but with flash-linear-attention installed, transformers'
    # Qwen3-Next calls its kernels, which run on CUDA only.
    on_cuda = case == "qwen3-next" and importlib.util.find_spec("fla") is not None
    path, prompts, expected = make_hybrid_reference(
        CASES[case](), (300, 1, 77, 513, 20), 16, "cuda" if on_cuda else "cpu"
    )
    llm = LLM(
        path,
        device="cuda",
        dtype="float32",
        enable_chunked_prefill=True,
        max_num_batched_tokens=128,
        max_num_seqs=3,  # fewer state slots than requests: slots are reused
        enforce_eager=enforce_eager,
        gpu_memory_utilization=0.3,
    )
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    # The engine's memory is given back before the verdict: a failing case (whose traceback would
    # keep it) must not leave the next one without memory.
    del llm, outputs
    gc.collect()
    torch.cuda.empty_cache()
    assert tokens == expected
