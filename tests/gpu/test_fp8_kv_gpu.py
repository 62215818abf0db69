"""The FP8 KV cache on CUDA: the Triton kernels in bfloat16 at serving shapes against the torch
backend over the same FP8 cache, and the engine with CUDA graphs and prefix caching."""

from __future__ import annotations

import gc
import random

import pytest
import torch
from transformers import LlamaConfig

from pagedllm import LLM, SamplingParams
from pagedllm.attention.backends.torch_backend import TorchAttentionBackend
from pagedllm.attention.backends.triton_backend import TritonAttentionBackend
from pagedllm.attention.metadata import AttentionMetadata

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
K_SCALE, V_SCALE = 0.03, 0.07


def _batch(context_lens, query_lens, num_decodes, num_heads, num_kv_heads, head_size, block_size):
    gen = torch.Generator().manual_seed(0)
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    blocks = [-(-n // block_size) for n in seq_lens]
    perm = torch.randperm(sum(blocks), generator=gen)
    tables = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
    first = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = perm[first : first + n]
        first += n
    slots = []
    for i, (c, q) in enumerate(zip(context_lens, query_lens)):
        pos = torch.arange(c, c + q)
        slots.append(tables[i, pos // block_size].long() * block_size + pos % block_size)
    query_start = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    md = AttentionMetadata(
        num_decodes=num_decodes,
        num_prefills=len(seq_lens) - num_decodes,
        slot_mapping=torch.cat(slots).cuda(),
        query_start_loc=query_start.cuda(),
        seq_lens=seq_lens_t.cuda(),
        block_tables=tables.cuda(),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=query_start,
        seq_lens_cpu=seq_lens_t,
    )
    # The contexts: N(0, 1) K and V as the FP8 cache stores them.
    shape = (sum(blocks), num_kv_heads, block_size, head_size)
    caches = [
        (torch.randn(shape, generator=gen) / scale).clamp(-448, 448).to(torch.float8_e4m3fn).cuda()
        for scale in (K_SCALE, V_SCALE)
    ]
    num_tokens = int(query_start[-1])
    heads = (num_heads, num_kv_heads, num_kv_heads)
    qkv = [torch.randn(num_tokens, h, head_size, device="cuda").bfloat16() for h in heads]
    return qkv, caches, md


@pytest.mark.parametrize("head_size", [64, 128])
def test_triton_fp8_matches_torch_backend_in_bf16(head_size: int) -> None:
    """Decodes over 4,096 and 1,000 tokens and a 300-token chunk after a 700-token prefix."""
    num_heads, num_kv_heads, block_size = 32, 8, 16
    (q, k, v), caches, md = _batch(
        [4095, 999, 700], [1, 1, 300], 2, num_heads, num_kv_heads, head_size, block_size
    )
    scale = head_size**-0.5
    triton_layer = TritonAttentionBackend(num_heads, head_size, scale, num_kv_heads)
    torch_layer = TorchAttentionBackend(num_heads, head_size, scale, num_kv_heads)
    for layer in (triton_layer, torch_layer):
        layer.k_scale = torch.tensor(K_SCALE, device="cuda")
        layer.v_scale = torch.tensor(V_SCALE, device="cuda")
    torch_caches = tuple(
        c.view(torch.uint8).permute(0, 2, 1, 3).contiguous().view(torch.float8_e4m3fn) for c in caches
    )
    out = triton_layer.forward(q, k, v, tuple(caches), md)
    ref = torch_layer.forward(q.float(), k.float(), v.float(), torch_caches, md)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    # The same bytes written by both cache writes (correctly rounded division, round to nearest even).
    for a, b in zip(caches, torch_caches):
        assert torch.equal(a.view(torch.uint8).permute(0, 2, 1, 3), b.view(torch.uint8))


@pytest.fixture
def tiny_gpu_model(make_tiny_model):
    return make_tiny_model(LlamaConfig, num_attention_heads=4, num_key_value_heads=2, head_dim=64)


def _prompts(vocab_size: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, vocab_size) for _ in range(rng.randint(5, 70))] for _ in range(6)]


def test_fp8_engine_cuda_graphs_and_prefix_caching_equal_eager(tiny_gpu_model) -> None:
    """float32 with an FP8 cache (so that reduction order cannot flip a token): CUDA graphs give
    eager's tokens; prompts served again from their cached FP8 blocks give the same tokens; the
    torch backend on the same cache dtype agrees on most tokens (the same quantization)."""
    _, model_config = tiny_gpu_model
    prompts = _prompts(model_config.vocab_size)
    kwargs = dict(dtype="float32", kv_cache_dtype="fp8", gpu_memory_utilization=0.3, block_size=16)

    def run(llm: LLM) -> list[list[int]]:
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    def tokens(**extra) -> list[list[int]]:
        llm = LLM(model_config.model, **kwargs, **extra)
        result = run(llm)
        if extra.get("enable_prefix_caching"):
            # Served again: every full prompt block now comes from the FP8 prefix cache.
            assert run(llm) == result
        del llm
        gc.collect()
        torch.cuda.empty_cache()
        return result

    eager = tokens(enforce_eager=True)
    assert tokens(enforce_eager=False) == eager
    assert tokens(enable_prefix_caching=True) == eager
    reference = tokens(attention_backend="torch", enforce_eager=True)
    same = sum(a == b for ra, rb in zip(reference, eager) for a, b in zip(ra, rb))
    assert same >= 0.9 * sum(len(r) for r in eager)


def test_fp8_cache_doubles_the_profiled_blocks(tiny_gpu_model) -> None:
    _, model_config = tiny_gpu_model
    kwargs = dict(dtype="bfloat16", gpu_memory_utilization=0.3, enforce_eager=True)
    bf16 = LLM(model_config.model, **kwargs).llm_engine.num_gpu_blocks
    fp8 = LLM(model_config.model, kv_cache_dtype="fp8", **kwargs).llm_engine.num_gpu_blocks
    assert abs(fp8 / bf16 - 2.0) < 0.05
