"""Long context on CUDA: the long-context families (``long_context_case`` in tests/conftest.py) in
float32 on the triton and cuda backends, greedy-equal to Hugging Face ``generate`` on the same
GPU, with chunked prefill and prefix caching; and the attention variants (sliding window, ALiBi,
soft cap) of both backends' kernels against the torch oracle at realistic sizes."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch

if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("needs CUDA and compiled (not interpreted) Triton kernels", allow_module_level=True)

from pagedllm import LLM, SamplingParams
from pagedllm.attention.backends.cuda_backend import CudaAttentionBackend
from pagedllm.attention.backends.torch_backend import TorchAttentionBackend
from pagedllm.attention.backends.triton_backend import TritonAttentionBackend
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.kernels.cuda.layout import from_triton_layout

pytestmark = pytest.mark.gpu

DEVICE = torch.device("cuda")
MAX_TOKENS = 8


@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_greedy_equals_hf_on_the_gpu(
    long_context_model: Callable, long_context_case: str, backend: str
) -> None:
    model, prompts, expected = long_context_model(long_context_case, MAX_TOKENS, "cuda")
    for engine_kwargs in (
        {"block_size": 16},
        {"block_size": 8, "enable_chunked_prefill": True, "max_num_batched_tokens": 48, "max_num_seqs": 4},
        {"block_size": 16, "enable_prefix_caching": True},
    ):
        llm = LLM(
            model,
            device="cuda",
            dtype="float32",
            attention_backend=backend,
            max_model_len=512,
            num_kv_blocks=256,
            **engine_kwargs,
        )
        greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outputs = llm.generate(prompt_token_ids=prompts, sampling_params=greedy, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected, engine_kwargs
        del llm


def _step(
    context_lens: list[int], query_lens: list[int], num_decodes: int, num_heads: int, num_kv_heads: int
) -> tuple:
    """(query, key, value, Triton-layout caches with NaN in unused slots, metadata); head 128,
    block 16, float32."""
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    head_size, block_size = 128, 16
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 4
    perm = torch.randperm(num_blocks, generator=gen, device=DEVICE).to(torch.int32)
    block_tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32, device=DEVICE)
    shape = (num_blocks, num_kv_heads, block_size, head_size)
    caches = [torch.full(shape, float("nan"), device=DEVICE) for _ in range(2)]
    slots, first = [], 0
    for i, (n, ctx) in enumerate(zip(blocks_per_seq, context_lens)):
        block_tables[i, :n] = perm[first : first + n]
        first += n
        pos = torch.arange(seq_lens[i], device=DEVICE)
        seq_slots = block_tables[i, pos // block_size].long() * block_size + pos % block_size
        blocks, offsets = seq_slots[:ctx] // block_size, seq_slots[:ctx] % block_size
        for cache in caches:
            cache[blocks, :, offsets] = torch.randn(
                ctx, num_kv_heads, head_size, generator=gen, device=DEVICE
            )
        slots.append(seq_slots[ctx:])
    slot_mapping = torch.cat(slots)
    num_tokens = slot_mapping.shape[0]

    def rand(heads: int) -> torch.Tensor:
        return torch.randn(num_tokens, heads, head_size, generator=gen, device=DEVICE)

    query_start_loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens_cpu = torch.tensor(seq_lens, dtype=torch.int32)
    md = AttentionMetadata(
        num_decodes=num_decodes,
        num_prefills=len(seq_lens) - num_decodes,
        slot_mapping=slot_mapping,
        query_start_loc=query_start_loc.to(DEVICE),
        seq_lens=seq_lens_cpu.to(DEVICE),
        block_tables=block_tables,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens_cpu,
    )
    return rand(num_heads), rand(num_kv_heads), rand(num_kv_heads), caches, md


VARIANTS = {
    "window128": {"sliding_window": 128},
    "window4096": {"sliding_window": 4096},
    "window1000-softcap": {"sliding_window": 1000, "logits_soft_cap": 30.0},
    "softcap": {"logits_soft_cap": 5.0},
    "alibi": {"alibi_slopes": torch.linspace(0.01, 0.3, 32)},
}


@pytest.mark.parametrize(
    "backend_cls", [TritonAttentionBackend, CudaAttentionBackend], ids=["triton", "cuda"]
)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variants_match_torch_at_k1_shapes(backend_cls: type, variant: str) -> None:
    gen = torch.Generator().manual_seed(4)
    num_decodes = 24
    context_lens = torch.randint(0, 6000, (num_decodes + 3,), generator=gen).tolist()
    query_lens = [1] * num_decodes + [700, 300, 1]
    context_lens[num_decodes] = 0
    query, key, value, (key_cache, value_cache), md = _step(context_lens, query_lens, num_decodes, 32, 8)
    kwargs = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in VARIANTS[variant].items()}
    torch_caches = tuple(c.permute(0, 2, 1, 3).contiguous() for c in (key_cache, value_cache))
    ref = TorchAttentionBackend(32, 128, 128**-0.5, 8, **kwargs).forward(query, key, value, torch_caches, md)
    caches = (key_cache, value_cache)
    if backend_cls is CudaAttentionBackend:
        backend_cls.check_supported(128, 16, torch.float32, DEVICE)
        caches = from_triton_layout(key_cache, value_cache)
    out = backend_cls(32, 128, 128**-0.5, 8, **kwargs).forward(query, key, value, caches, md)
    torch.cuda.synchronize()
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
