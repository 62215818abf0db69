"""LoRA on CUDA: the BGMV and SGMV kernels against the masked torch product at Llama-3.1-8B's q/k/v
shape (8 slots of rank 16, bf16), decode steps' kernels captured in a CUDA graph; the engine with
adapters on the GPU (CUDA graphs on, the kernels) giving the CPU path's greedy tokens, which
tests/lora checks against PEFT; two tensor-parallel GPUs giving one GPU's tokens with adapters;
``pagedllm bench lora`` end to end at a small size."""

from __future__ import annotations

import argparse
import os

import numpy as np
import pytest
import torch
from transformers import LlamaConfig

if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("needs CUDA and compiled (not interpreted) Triton kernels", allow_module_level=True)

from pagedllm import LLM, SamplingParams
from pagedllm.entrypoints.bench import lora as bench_lora
from pagedllm.lora.punica import NO_SLOT, LoRABatch
from pagedllm.lora.request import LoRARequest

pytestmark = pytest.mark.gpu
DEVICE = torch.device("cuda")
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.mark.parametrize(
    ("num_tokens", "has_prefill"),
    [(1, False), (37, False), (512, False), (37, True), (512, True), (4096, True)],
    ids=["decode-1", "decode-37", "decode-512", "prefill-37", "prefill-512", "prefill-4096"],
)
def test_kernels_equal_the_masked_product_at_8b_shape(num_tokens, has_prefill):
    slots, rank, hidden, sizes = 8, 16, 4096, (4096, 1024, 1024)
    gen = torch.Generator(device=DEVICE).manual_seed(num_tokens)
    x = torch.randn(num_tokens, hidden, device=DEVICE, generator=gen).bfloat16()
    lora_a = (0.05 * torch.randn(3 * slots * rank, hidden, device=DEVICE, generator=gen)).bfloat16()
    lora_b = (0.05 * torch.randn(sum(sizes), 3 * slots * rank, device=DEVICE, generator=gen)).bfloat16()
    # The slots' layout: slice i's adapters only in slice i's output rows (lora/layers.py).
    width, row = slots * rank, 0
    for i, size in enumerate(sizes):
        lora_b[:row, i * width : (i + 1) * width] = 0
        lora_b[row + size :, i * width : (i + 1) * width] = 0
        row += size
    token_slots = np.random.default_rng(0).integers(NO_SLOT, slots, num_tokens)
    y = torch.randn(num_tokens, sum(sizes), device=DEVICE, generator=gen).bfloat16()
    starts = (sizes[0], sizes[0] + sizes[1])
    reference = LoRABatch(slots, rank, num_tokens, {3}, torch.float32, DEVICE, use_kernels=False)
    reference.set_token_slots(token_slots)
    expected = y.float()
    reference.apply(expected, x.float(), lora_a.float(), lora_b.float(), 3, starts)
    kernels = LoRABatch(slots, rank, num_tokens, {3}, torch.bfloat16, DEVICE, use_kernels=True)
    kernels.set_token_slots(token_slots, has_prefill)
    got = y.clone()
    kernels.apply(got, x, lora_a, lora_b, 3, starts)
    torch.testing.assert_close(got.float(), expected, rtol=2e-2, atol=5e-2)


@pytest.mark.parametrize("num_tokens", [8, 16, 40], ids=["bgmv-8", "sgmv-16", "sgmv-40"])
def test_decode_kernels_replay_in_a_cuda_graph(num_tokens):
    """Decode steps' kernels (BGMV below 16 tokens, SGMV over a grid fixed by the token count
    from 16) captured once, replayed over new slots (and new segments) each step."""
    slots, rank, hidden, out = 4, 8, 256, 384
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    x = torch.randn(num_tokens, hidden, device=DEVICE, generator=gen).bfloat16()
    batch, lora_a, lora_b = slot_adapters(num_tokens, slots, rank, hidden, out, gen)
    y = torch.zeros(num_tokens, out, device=DEVICE, dtype=torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        batch.apply(y, x, lora_a, lora_b, 1, (out, out))
    for step in range(3):  # new slots each step, written into the buffers the graph reads
        token_slots = np.random.default_rng(step).integers(NO_SLOT, slots, num_tokens)
        batch.set_token_slots(token_slots)
        y.zero_()
        graph.replay()
        expected = per_token_lora(x, lora_a, lora_b, token_slots, rank)
        torch.testing.assert_close(y.float(), expected, rtol=2e-2, atol=3e-2)


@pytest.mark.parametrize("num_tokens", [1, 16], ids=["bgmv-1", "sgmv-16"])
def test_the_shrink_beside_the_base_projection_in_a_graph(num_tokens):
    """As a LoRA layer runs it under capture: the shrink forked to the side stream, the base GEMM
    on the layer's stream, the expand joining them. Replayed over new inputs and slots, the output
    is the base product plus each token's adapter's."""
    slots, rank, hidden, out = 4, 16, 512, 384
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    weight = (hidden**-0.5 * torch.randn(out, hidden, device=DEVICE, generator=gen)).bfloat16()
    batch, lora_a, lora_b = slot_adapters(num_tokens, slots, rank, hidden, out, gen)
    x = torch.zeros(num_tokens, hidden, device=DEVICE, dtype=torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        shrunk = batch.shrink(x, lora_a, 1)
        y = x @ weight.T
        batch.expand(y, shrunk, lora_b, (out, out))
    for step in range(3):
        x.copy_(torch.randn(num_tokens, hidden, device=DEVICE, generator=gen))
        token_slots = np.random.default_rng(step).integers(NO_SLOT, slots, num_tokens)
        batch.set_token_slots(token_slots)
        graph.replay()
        expected = x.float() @ weight.float().T + per_token_lora(x, lora_a, lora_b, token_slots, rank)
        torch.testing.assert_close(y.float(), expected, rtol=2e-2, atol=3e-2)


def slot_adapters(
    num_tokens: int, slots: int, rank: int, hidden: int, out: int, gen: torch.Generator
) -> tuple[LoRABatch, torch.Tensor, torch.Tensor]:
    """A decode batch of ``num_tokens`` tokens (none on a slot yet: what a graph is captured
    over) and random bf16 slot weights A [slots * rank, hidden], B [out, slots * rank]. B is
    scaled as a trained adapter's (and the test above's): with unit B, an output near zero is a
    cancellation of terms near 40, whose bf16 rounding of h (the expand's tl.dot operand) alone
    leaves 0.25 there."""
    batch = LoRABatch(slots, rank, 64, {1}, torch.bfloat16, DEVICE)
    lora_a = torch.randn(slots * rank, hidden, device=DEVICE, generator=gen).bfloat16()
    lora_b = (0.05 * torch.randn(out, slots * rank, device=DEVICE, generator=gen)).bfloat16()
    batch.set_token_slots(np.full(num_tokens, NO_SLOT))
    return batch, lora_a, lora_b


def per_token_lora(
    x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, token_slots: np.ndarray, rank: int
) -> torch.Tensor:
    """[T, out] float32: each token's own slot's (x A^T) B^T, one token at a time (0 without)."""
    expected = torch.zeros(x.shape[0], lora_b.shape[0], device=x.device)
    for t, s in enumerate(token_slots.tolist()):
        if s >= 0:
            a, b = lora_a[s * rank : (s + 1) * rank].float(), lora_b[:, s * rank : (s + 1) * rank].float()
            expected[t] = b @ (a @ x[t].float())
    return expected


@pytest.mark.parametrize("repeats", [1, 3], ids=["bgmv-decode", "sgmv-decode"])
def test_engine_with_adapters_on_cuda_gives_the_cpu_tokens(
    make_tiny_model, make_adapter, make_prompts, repeats
):
    """6 requests decode through BGMV (fewer than 16 tokens a step), 18 through SGMV over the
    CUDA graphs' fixed grids."""
    # head_dim 64: a head size the GPU attention kernels take.
    hf_model, model_config = make_tiny_model(
        LlamaConfig, hidden_size=256, num_attention_heads=4, num_key_value_heads=2
    )
    loras = [
        LoRARequest("a", 1, make_adapter(hf_model, 8, ["q_proj", "v_proj", "down_proj"])),
        LoRARequest("b", 2, make_adapter(hf_model, 4, ["k_proj", "o_proj", "gate_proj", "up_proj"])),
    ]
    choices = [loras[0], None, loras[1], loras[0], loras[1], None] * repeats
    prompts = make_prompts(len(choices), model_config.vocab_size, seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outputs = {}
    for device in ("cpu", "cuda"):
        llm = LLM(
            model_config.model, device=device, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8
        )
        result = llm.generate(
            prompt_token_ids=prompts, sampling_params=params, lora_request=choices, use_tqdm=False
        )
        outputs[device] = [o.outputs[0].token_ids for o in result]
        llm.llm_engine.shutdown()
        del llm
    assert outputs["cuda"] == outputs["cpu"]


@pytest.mark.two_gpus
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["cuda-graphs", "eager"])
def test_two_gpus_with_adapters_give_the_greedy_tokens_of_one(
    make_tiny_model, make_adapter, make_prompts, enforce_eager
):
    # 2 KV heads: each rank holds one; B of k/v is cut by head, A of o/down by column.
    hf_model, model_config = make_tiny_model(
        LlamaConfig, hidden_size=256, num_attention_heads=4, num_key_value_heads=2
    )
    loras = [
        LoRARequest("all", 1, make_adapter(hf_model, 16, ALL_TARGETS)),
        LoRARequest("kv", 2, make_adapter(hf_model, 4, ["k_proj", "v_proj", "down_proj"])),
    ]
    choices = [loras[0], None, loras[1], loras[0], loras[1], None]
    prompts = make_prompts(len(choices), model_config.vocab_size, seed=4, lo=3, hi=60)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    kwargs = dict(
        device="cuda", dtype="float32", enforce_eager=enforce_eager, num_kv_blocks=512,
        enable_lora=True, max_loras=2, max_lora_rank=16,
    )  # fmt: skip
    outputs = {}
    for tp in (1, 2):
        llm = LLM(model_config.model, tensor_parallel_size=tp, **kwargs)
        try:
            result = llm.generate(
                prompt_token_ids=prompts, sampling_params=params, lora_request=choices, use_tqdm=False
            )
            outputs[tp] = [o.outputs[0].token_ids for o in result]
        finally:
            llm.llm_engine.shutdown()
        del llm
        torch.cuda.empty_cache()
    assert outputs[2] == outputs[1]


def test_bench_lora_runs():
    args = argparse.Namespace(
        num_tokens=[1, 64], num_slots=4, rank=8, shapes=["qwen3-0.6b"], prefill_tokens=256, output_json=None
    )
    report = bench_lora.main(args)
    assert [row["num_tokens"] for row in report["rows"]] == [1, 64]
    paths = ("bgmv_ms", "sgmv_ms", "decode_ms", "torch_ms")
    assert all(row[path] > 0 for row in report["rows"] for path in paths)
    prefill = report["prefill_rows"]
    assert [row["projection"] for row in prefill] == ["qkv", "o", "gate_up", "down"]
    assert all(row["sgmv_first_ms"] > 0 and row["sgmv_ms"] > 0 and row["bgmv_ms"] > 0 for row in prefill)
