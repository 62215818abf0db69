"""Small calls of every Triton kernel wrapper, covering the variants the engine launches (dtypes,
attention variants, one or several decode partitions, each MoE tile class). ``sm90_compile.py``
runs them with launches replaced by compiles for sm_90; the tensors stay on the CPU and no kernel
runs, so only shapes, dtypes and strides matter here."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np
import torch

from pagedllm.attention.backends.triton_invariant_backend import invariant_launch
from pagedllm.kernels.bench import DecodeInputs, DecodeShape
from pagedllm.kernels.triton.activation import silu_and_mul
from pagedllm.kernels.triton.all_reduce_norm import all_reduce_add_rms_norm
from pagedllm.kernels.triton.batch_invariant_matmul import batch_invariant_matmul
from pagedllm.kernels.triton.causal_conv1d import causal_conv1d_update, causal_conv1d_varlen
from pagedllm.kernels.triton.fused_moe import fused_moe, moe_sum
from pagedllm.kernels.triton.greedy_verify import greedy_verify
from pagedllm.kernels.triton.linear_attention import gated_delta_rule_update, l2_normalize_, rms_norm_gated
from pagedllm.kernels.triton.lora import lora_shrink_expand
from pagedllm.kernels.triton.lora_sgmv import SegmentBuffer, lora_sgmv_shrink_expand, plan_segments
from pagedllm.kernels.triton.mla_decode import MLALaunch, mla_decode
from pagedllm.kernels.triton.moe_routing import MAX_EXPERTS, topk_softmax
from pagedllm.kernels.triton.ngram_lookup import ngram_lookup
from pagedllm.kernels.triton.paged_decode import paged_decode
from pagedllm.kernels.triton.paged_prefill import paged_prefill
from pagedllm.kernels.triton.quant_gemm import _fp8_quant_kernel, fp8_block_gemm, w4a16_gemm
from pagedllm.kernels.triton.reshape_and_cache import reshape_and_cache
from pagedllm.kernels.triton.rms_norm import fused_add_rms_norm, rms_norm
from pagedllm.kernels.triton.rotary import rotary_embedding
from pagedllm.kernels.triton.sampling import warm_up
from pagedllm.kernels.triton.sigmoid_gate import sigmoid_gate
from pagedllm.kernels.triton.skinny_gemm import skinny_gemm
from pagedllm.kernels.triton.ssd import ssd_state_update
from pagedllm.kernels.triton.state_rows import gather_state_rows, scatter_state_rows
from pagedllm.kernels.triton.take_back import take_back

CPU = torch.device("cpu")
DTYPES = (torch.bfloat16, torch.float32)
NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 8, 2, 128, 16


def _variants(num_heads: int, query: torch.Tensor) -> list[dict]:
    """The attention variants (AttentionBackend's): none, a window, ALiBi, a soft cap, sinks; then
    context parallelism's partial launches (lse out) on rank 1 of 2 with none, a window, ALiBi and
    a soft cap, and at P = 1."""
    partial = {"lse": torch.empty(query.shape[:2])}
    rank1 = {"cp_rank": 1, "cp_world_size": 2, **partial}
    return [
        {},
        {"sliding_window": 32},
        {"alibi_slopes": torch.ones(num_heads)},
        {"logits_soft_cap": 30.0},
        {"sliding_window": 32, "attention_sinks": 4, "sink_query": torch.empty_like(query)},
        rank1,
        {**rank1, "sliding_window": 32},
        {**rank1, "alibi_slopes": torch.ones(num_heads), "logits_soft_cap": 30.0},
        partial,
    ]


def _launch_decode(
    inputs: DecodeInputs, key_cache: torch.Tensor, value_cache: torch.Tensor, max_seq_len: int, **options
) -> None:
    """paged_decode over ``inputs``' query and tables, with the tiles each dtype launches with."""
    float32 = inputs.query.dtype == torch.float32
    paged_decode(
        inputs.query,
        key_cache,
        value_cache,
        inputs.block_tables,
        inputs.seq_lens,
        inputs.scale,
        max_seq_len,
        torch.empty_like(inputs.query),
        block_n=32 if float32 else 64,
        num_warps=8 if float32 else 4,
        **options,
    )


def decode() -> None:
    # Query groups (speculative verifications): 4 tokens x 4 heads fill the 16-row tile, 5 pad it
    # to 32; with the variants they allow.
    query_lens = {"query_lens": torch.tensor([0, 2], dtype=torch.int32)}
    grouped = [
        {**query_lens, "max_query_len": 4, **variant}
        for variant in (
            {},
            {"alibi_slopes": torch.ones(NUM_HEADS)},
            {"logits_soft_cap": 30.0},
            {"sinks": torch.zeros(NUM_HEADS)},
        )
    ] + [{**query_lens, "max_query_len": 5}]
    for dtype in DTYPES:
        inputs = DecodeInputs.random(
            DecodeShape((40, 300), NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE, dtype), CPU, seed=0
        )
        # A decode-only step's own cache write (decode_append.py), rotating and not, with a window.
        new = torch.empty(2, NUM_KV_HEADS, HEAD_SIZE, dtype=dtype)
        slots = torch.zeros(2, dtype=torch.int64)
        rotary = (torch.empty(64, HEAD_SIZE, dtype=dtype), torch.zeros(2, dtype=torch.int64))
        appends = [
            {"append": (new, new, slots, rotary)},
            {"append": (new, new, slots, None)},
            {"append": (new, new, slots, rotary), "sliding_window": 32},
        ]
        # One partition, then several (a host bound past the contexts, as under CUDA graphs).
        launches = [
            (max_seq_len, partition_size, variant)
            for variant in _variants(NUM_HEADS, inputs.query)
            for max_seq_len, partition_size in ((300, 512), (1024, 128))
        ] + [(1024, 128, variant) for variant in grouped + appends]
        launches.append((300, 512, appends[0]))
        for max_seq_len, partition_size, variant in launches:
            _launch_decode(
                inputs,
                inputs.key_cache,
                inputs.value_cache,
                max_seq_len,
                partition_size=partition_size,
                **variant,
            )


def prefill() -> None:
    for dtype in DTYPES:
        inputs = DecodeInputs.random(
            DecodeShape((40, 300), NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE, dtype), CPU, seed=0
        )
        query = torch.empty(50, NUM_HEADS, HEAD_SIZE, dtype=dtype)  # 10 + 40 new tokens
        query_start_loc = torch.tensor([0, 10, 50], dtype=torch.int32)
        for variant in _variants(NUM_HEADS, query):
            paged_prefill(
                query,
                inputs.key_cache,
                inputs.value_cache,
                inputs.block_tables,
                inputs.seq_lens,
                query_start_loc,
                inputs.scale,
                0,
                2,
                40,
                torch.empty_like(query),
                block_m=32 if dtype == torch.float32 else 64,
                block_n=16 if dtype == torch.float32 else 64,
                num_warps=8 if dtype == torch.float32 else 4,
                **variant,
            )


def cache_write() -> None:
    for dtype in DTYPES:
        key = torch.empty(5, NUM_KV_HEADS, HEAD_SIZE, dtype=dtype)
        cache = torch.empty(4, NUM_KV_HEADS, BLOCK_SIZE, HEAD_SIZE, dtype=dtype)
        slots = torch.arange(5, dtype=torch.int64)
        reshape_and_cache(key, key.clone(), cache, cache.clone(), slots)
        query = torch.empty(5, NUM_HEADS, HEAD_SIZE, dtype=dtype)
        cos_sin = torch.empty(64, HEAD_SIZE, dtype=dtype)
        reshape_and_cache(key, key.clone(), cache, cache.clone(), slots, rotary=(query, cos_sin, slots))


def fp8_kv_cache() -> None:
    """kv_cache_dtype="fp8": float8_e4m3fn caches under bfloat16 and float32 queries, with the
    layer's scales; the cache write with and without rotary."""
    for dtype in DTYPES:
        inputs = DecodeInputs.random(
            DecodeShape((40, 300), NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE, dtype), CPU, seed=0
        )
        key_cache, value_cache = (c.to(torch.float8_e4m3fn) for c in (inputs.key_cache, inputs.value_cache))
        scales = {"k_scale": torch.ones(()), "v_scale": torch.ones(())}
        sinks = {"sliding_window": 32, "attention_sinks": 4, "sink_query": torch.empty_like(inputs.query)}
        new = torch.empty(2, NUM_KV_HEADS, HEAD_SIZE, dtype=dtype)
        rotary = (torch.empty(64, HEAD_SIZE, dtype=dtype), torch.zeros(2, dtype=torch.int64))
        append = {"append": (new, new, torch.zeros(2, dtype=torch.int64), rotary)}
        for variant in ({}, sinks, append):
            for max_seq_len, partition_size in ((300, 512), (1024, 128)):
                _launch_decode(
                    inputs,
                    key_cache,
                    value_cache,
                    max_seq_len,
                    partition_size=partition_size,
                    **scales,
                    **variant,
                )
        query = torch.empty(50, NUM_HEADS, HEAD_SIZE, dtype=dtype)
        paged_prefill(
            query,
            key_cache,
            value_cache,
            inputs.block_tables,
            inputs.seq_lens,
            torch.tensor([0, 10, 50], dtype=torch.int32),
            inputs.scale,
            0,
            2,
            40,
            torch.empty_like(query),
            block_m=32 if dtype == torch.float32 else 64,
            block_n=16 if dtype == torch.float32 else 64,
            num_warps=8 if dtype == torch.float32 else 4,
            **scales,
        )
        key = torch.empty(5, NUM_KV_HEADS, HEAD_SIZE, dtype=dtype)
        slots = torch.arange(5, dtype=torch.int64)
        kv_scales = (scales["k_scale"], scales["v_scale"])
        reshape_and_cache(key, key.clone(), key_cache, value_cache, slots, kv_scales=kv_scales)
        rotary = (query[:5], torch.empty(64, HEAD_SIZE, dtype=dtype), slots)
        reshape_and_cache(key, key.clone(), key_cache, value_cache, slots, rotary=rotary, kv_scales=kv_scales)


def moe() -> None:
    experts, top_k, hidden, width = 128, 8, 64, 32
    for dtype in DTYPES:
        w13 = torch.empty(experts, 2 * width, hidden, dtype=dtype)
        w2 = torch.empty(experts, hidden, width, dtype=dtype)
        # 16-, 32-, 64- and 128-row tiles: 1, 256, 1,024 and 4,096 tokens at top-8 of 128.
        for num_tokens in (1, 256, 1024, 4096):
            x = torch.empty(num_tokens, hidden, dtype=dtype)
            ids = torch.randint(0, experts, (num_tokens, top_k))
            fused_moe(x, w13, w2, torch.rand(num_tokens, top_k), ids)
        # The router: W6's 16 experts, Qwen3-MoE's 128, Qwen3-Next-80B's 512 (16, 16, 4 tokens
        # a program), the widest row (one token, 16 warps); top-1 (one-wide slot tiles) to top-10.
        for num_experts, k in ((16, 8), (128, 8), (512, 10), (MAX_EXPERTS, 1)):
            for renormalize in (True, False):
                topk_softmax(torch.empty(5, num_experts, dtype=dtype), k, renormalize)
        # An absorbed shared expert: W6's, gated by the router's 17th column (its rows padded to
        # 32); and two ungated.
        topk_softmax(torch.empty(5, 32, dtype=dtype)[:, :17], 8, True, num_shared=1, shared_gate=True)
        topk_softmax(torch.empty(5, 64, dtype=dtype), 6, False, num_shared=2)
        # The combine at W6's width (1,024-column blocks), with and without a shared expert.
        slots = torch.empty(3, top_k, 2048, dtype=dtype)
        moe_sum(slots)
        moe_sum(slots, torch.empty(3, 2048, dtype=dtype), torch.empty(3, 1, dtype=dtype))


def layers() -> None:
    for dtype in DTYPES:
        x = torch.empty(3, 576, dtype=dtype)
        rms_norm(x, torch.empty(576, dtype=dtype), 1e-6)
        fused_add_rms_norm(x, x.clone(), torch.empty(576, dtype=dtype), 1e-6)
        heads = torch.empty(3, 16, HEAD_SIZE, dtype=dtype)  # Qwen3's per-head q/k norms
        rms_norm(heads, torch.empty(HEAD_SIZE, dtype=dtype), 1e-6)
        # Gemma's order (GemmaRMSNorm: Gemma, Qwen3-Next): its norms without and with the residual
        # add, and the heads'.
        rms_norm(x, torch.empty(576, dtype=dtype), 1e-6, gemma=True)
        fused_add_rms_norm(x, x.clone(), torch.empty(576, dtype=dtype), 1e-6, gemma=True)
        rms_norm(heads, torch.empty(HEAD_SIZE, dtype=dtype), 1e-6, gemma=True)
        positions = torch.arange(3)
        rotary_embedding(
            positions,
            torch.empty(3, NUM_HEADS * HEAD_SIZE, dtype=dtype),
            torch.empty(3, NUM_KV_HEADS * HEAD_SIZE, dtype=dtype),
            torch.empty(64, HEAD_SIZE, dtype=dtype),
            HEAD_SIZE,
        )
        # A partial rotation: Qwen3-Next's first 64 of 256 dimensions of 16 q and 2 kv heads.
        rotary_embedding(
            positions,
            torch.empty(3, 16 * 256, dtype=dtype),
            torch.empty(3, 2 * 256, dtype=dtype),
            torch.empty(64, 64, dtype=dtype),
            256,
            64,
        )
        silu_and_mul(torch.empty(3, 2 * 1536, dtype=dtype))
        # Gated attention's output gate at Qwen3-Next's 16 heads of 256, the gate a strided view.
        q_gate = torch.empty(3, 16, 2 * 256, dtype=dtype)
        sigmoid_gate(torch.empty(3, 16, 256, dtype=dtype), q_gate[..., 256:])
    warm_up(49152, CPU)  # the sampler's variants and the grammar bitmask
    warm_up(49152, CPU, invariant=True)  # batch_invariant=True's: one chunk size, no FMA contraction
    # Speculative decoding's greedy verification: by the target's argmax and synthetic.
    drafts, argmax = torch.zeros(2, 3, dtype=torch.int64), torch.zeros(6, dtype=torch.int64)
    for rate in (None, 0.7):
        greedy_verify(drafts, np.array([3, 1]), argmax, rate)
    # And its n-gram lookup on the device (k = 3 with lookups of 2-4, and k = 5 with 1-5).
    table, rows, newest = torch.zeros(4, 64, dtype=torch.int32), torch.arange(2), torch.tensor([5, 60])
    for k, min_n, max_n in ((3, 2, 4), (5, 1, 5)):
        ngram_lookup(table, rows, newest, k, min_n, max_n)
    # And the deferred take-back of a step planned over optimistic counts.
    int64, int32 = torch.zeros(8, dtype=torch.int64), torch.zeros(8, dtype=torch.int32)
    tables = torch.zeros(8, 64, dtype=torch.int32)
    take_back(int64[:2], int32, int64, int32.clone(), tables, int64.clone(), 16)


def lora() -> None:
    # A fused q/k/v projection with 8 slots of rank 16, and a rank-8 unfused one.
    for dtype in DTYPES:
        for slices, rank in (((4096, 1024, 1024), 16), ((4096,), 8)):
            width = len(slices) * 8 * rank
            starts = (slices[0], slices[0] + slices[1]) if len(slices) == 3 else (slices[0], slices[0])
            for num_tokens in (5, 64, 12000, 20000):
                y = torch.empty(num_tokens, sum(slices), dtype=dtype)
                x = torch.empty(num_tokens, 4096, dtype=dtype)
                weights = (
                    torch.empty(width, 4096, dtype=dtype),
                    torch.empty(sum(slices), width, dtype=dtype),
                )
                if num_tokens <= 64:  # BGMV (decode): narrow and wide expand tiles
                    slots = torch.zeros(num_tokens, dtype=torch.int64)
                    lora_shrink_expand(y, x, *weights, slots, 8, rank, starts)
                # SGMV (prefill): BLOCK_M 16 (5, 64 and 12000 tokens: K split for the first two)
                # and 64 (20000), unsplit.
                plan = plan_segments(torch.arange(num_tokens).numpy() % 8, 8, CPU)
                lora_sgmv_shrink_expand(y, x, *weights, plan, 8, rank, starts)
                if num_tokens == 64:  # SGMV (decode): a grid fixed by the token count
                    plan = SegmentBuffer(num_tokens, 8, CPU).plan(np.zeros(num_tokens), 16, fixed_grid=True)
                    lora_sgmv_shrink_expand(y, x, *weights, plan, 8, rank, starts)


def batch_invariant() -> None:
    """batch_invariant=True's GEMM (both schedules, with and without a bias) and its attention's
    two launches (no FMA contraction)."""
    for dtype in DTYPES:
        x, weight, bias = torch.empty(5, 1024, dtype=dtype), torch.empty(384, 1024, dtype=dtype), None
        for split_in_grid in (True, False):
            for bias in (None, torch.empty(384, dtype=dtype)):
                batch_invariant_matmul(x, weight, bias, 4, split_in_grid=split_in_grid)
        inputs = DecodeInputs.random(
            DecodeShape((40, 300), NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE, dtype), CPU, seed=0
        )
        query = torch.empty(41, NUM_HEADS, HEAD_SIZE, dtype=dtype)  # a decode and a 40-token chunk
        query_start_loc = torch.tensor([0, 1, 41], dtype=torch.int32)
        for variant in _variants(NUM_HEADS, query):
            for prefill in (False, True):  # the decodes' launch and the prefill chunks'
                paged_prefill(
                    query, inputs.key_cache, inputs.value_cache, inputs.block_tables, inputs.seq_lens,
                    query_start_loc, inputs.scale, 0, 2, 40, torch.empty_like(query),
                    **invariant_launch(HEAD_SIZE, dtype, prefill), **variant,
                )  # fmt: skip


def quant() -> None:
    """The quantized GEMMs in 16-bit: the skinny decode kernel (FP8 per channel and in 128 x 128
    blocks, 4-bit in groups of 128 and one group per row; both products, over all of K and split),
    the W4A16 dequantization and the FP8 block GEMM, and the activation quantization (called
    directly: its wrapper rounds CPU tensors with torch)."""
    n, k, e4m3 = 256, 1024, torch.float8_e4m3fn
    fp8, packed = torch.empty(n, k, dtype=e4m3), torch.empty(n, k // 8, dtype=torch.int32)
    for dtype in (torch.bfloat16, torch.float16):
        for rows, product in itertools.product((1, 4, 5), ({"num_splits": 1}, {"num_splits": 2})):
            x = torch.empty(rows, k, dtype=dtype)
            for fma in (0, 1):
                launch = product | {"fma": fma}
                skinny_gemm(x, fp8, torch.empty(n, 1), k, launch=launch)
                skinny_gemm(x, fp8, torch.empty(n // 128, k // 128), 128, 128, launch=launch)
                for group in (128, k):
                    groups = torch.empty(n, k // group, dtype=dtype)
                    skinny_gemm(x, packed, groups, group, zeros=groups, launch=launch)
        w4a16_gemm(torch.empty(40, k, dtype=dtype), packed, groups, groups, k)
        fp8_block_gemm(torch.empty(40, k, dtype=dtype), fp8, torch.empty(n // 128, k // 128), (128, 128))
        for group, block in ((k, 1024), (128, 128)):
            q, scale = torch.empty(40, k, dtype=e4m3), torch.empty(40, k // group)
            _fp8_quant_kernel[(40, k // group)](x, q, scale, k, group, k, k, k // group, BLOCK=block)


def mla() -> None:
    """The MLA decode at DeepSeek's latent (512 + 64) with V2-Lite's 16 heads and V3's 128, in one
    partition and several, at the engine's launch per dtype and every launch bench mla --sweep
    tries in bf16 (those past the device's limits must fail as OutOfResources, which the sweep
    skips)."""
    from triton.runtime.errors import OutOfResources

    from pagedllm.entrypoints.bench.mla import SWEEP

    seq_lens, block_tables = torch.tensor([40, 300], dtype=torch.int32), torch.zeros(2, 64, dtype=torch.int32)
    for dtype in DTYPES:
        cache = torch.empty(8, BLOCK_SIZE, 576, dtype=dtype)
        for num_heads in (16, 128):
            q_latent, q_pe = (
                torch.empty(2, num_heads, 512, dtype=dtype),
                torch.empty(2, num_heads, 64, dtype=dtype),
            )
            out = torch.empty_like(q_latent)
            for max_seq_len, partition_size in ((300, 1024), (1024, 256)):
                args = (q_latent, q_pe, cache, block_tables, seq_lens, 0.1, max_seq_len, out)
                mla_decode(*args, partition_size=partition_size)
                for launch in SWEEP if dtype == torch.bfloat16 and num_heads == 16 else ():
                    try:
                        mla_decode(*args, partition_size=partition_size, launch=MLALaunch(*launch))
                    except OutOfResources:
                        print(f"out of resources: {launch}")


def conv1d() -> None:
    """The linear-attention layers' conv at a Qwen3-Next-like split (q and k of 2 heads x 128
    channels, v of 4 x 128): the decode and the varlen prefill, through a column map into a wider
    fused projection and without, with and without a bias, the prefill with long and short chunks
    (its tallest and shortest token tiles)."""
    splits = (256, 256, 512)
    channels = sum(splits)
    slots, has_state = torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.bool)
    query_start_loc = torch.tensor([0, 10, 50], dtype=torch.int32)
    for dtype in DTYPES:
        weight, bias = torch.empty(channels, 4, dtype=dtype), torch.empty(channels, dtype=dtype)
        conv_state = torch.empty(9, channels, 3, dtype=dtype)
        projection = torch.empty(50, 2 * channels, dtype=dtype)
        cols = torch.empty(channels, dtype=torch.int32)
        # No map; a gathered map; a map of whole 128-column runs (Qwen3-Next's, read as vectors).
        inputs = ((projection[:, :channels], None, 1), (projection, cols, 1), (projection, cols, 128))
        for (x, cols, run), b in itertools.product(inputs, (None, bias)):
            causal_conv1d_update(x[:2], weight, b, conv_state, slots, has_state, cols=cols, cols_run=run)
            for max_query_len in (40, 4):
                args = (conv_state, slots, has_state, query_start_loc, max_query_len, splits, cols, run)
                causal_conv1d_varlen(x, weight, b, *args)


def gated_deltanet() -> None:
    """Gated DeltaNet's decode step (its gates read from strided views of a fused projection, as
    Qwen3-Next's), its gated output norm, the prefill's l2 normalisation and its state rows'
    gather and scatter, at W6's head shape."""
    batch, num_k_heads, group, d = 4, 2, 2, 128
    num_v_heads = num_k_heads * group
    for dtype in DTYPES:
        conv_out = torch.empty(batch, (2 * num_k_heads + num_v_heads) * d, dtype=dtype)
        q, k, v = conv_out.split([num_k_heads * d, num_k_heads * d, num_v_heads * d], dim=-1)
        q, k, v = q.view(batch, num_k_heads, d), k.view(batch, num_k_heads, d), v.view(batch, num_v_heads, d)
        b, a = torch.empty(batch, num_k_heads, 2 * group, dtype=dtype).split([group, group], -1)
        heads = torch.empty(num_v_heads)
        state = torch.empty(9, num_v_heads, d, d, dtype=dtype)
        slots, has_state = torch.zeros(batch, dtype=torch.int64), torch.zeros(batch, dtype=torch.bool)
        gated_delta_rule_update(q, k, v, a, b, heads, heads, state, slots, has_state)
        l2_normalize_(torch.empty(batch, num_k_heads, d, dtype=dtype))
        fused = torch.empty(batch, num_k_heads, 3 * group * d, dtype=dtype)
        gate = fused[..., 2 * group * d :].unflatten(-1, (group, d))
        rms_norm_gated(
            torch.empty(batch, num_v_heads, d, dtype=dtype), gate, torch.empty(d, dtype=dtype), 1e-6
        )
        # The fla prefill's state rows: gathered in the cache's dtype, its float32 states stored.
        rows = gather_state_rows(state, slots, has_state)
        scatter_state_rows(state, slots, rows.float())


def mamba2() -> None:
    """Mamba-2's decode step at Nemotron-H-8B's head shape (head_dim 64, d_state 128, 8 groups;
    x, B and C views of the conv's output), the state in the model's dtype and in float32."""
    batch, num_heads, n_groups, head_dim, d_state = 4, 16, 8, 64, 128
    slots, has_state = torch.zeros(batch, dtype=torch.int64), torch.zeros(batch, dtype=torch.bool)
    for dtype, state_dtype in (
        (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32),
        (torch.float32,) * 2,
    ):
        conv_out = torch.empty(batch, num_heads * head_dim + 2 * n_groups * d_state, dtype=dtype)
        x, B, C = conv_out.split([num_heads * head_dim, n_groups * d_state, n_groups * d_state], dim=-1)
        x = x.view(batch, num_heads, head_dim)
        B, C = B.view(batch, n_groups, d_state), C.view(batch, n_groups, d_state)
        state = torch.empty(9, num_heads, head_dim, d_state, dtype=state_dtype)
        heads = torch.empty(num_heads)
        ssd_state_update(x, B, C, torch.empty(batch, num_heads), heads, heads, state, slots, has_state)


def all_reduce_norm() -> None:
    """The tensor-parallel all-reduce + residual add + RMSNorm (two ranks, the rank a constexpr)."""
    peers = torch.zeros(2, dtype=torch.int64)
    for dtype in (torch.bfloat16, torch.float32):
        for hidden in (4096, 5120):
            x = torch.empty(3, hidden, dtype=dtype)
            for rank in (0, 1):
                all_reduce_add_rms_norm(
                    x, x.clone(), torch.empty(hidden, dtype=dtype), 1e-6, peers, 1024, rank
                )


LAUNCHES: list[Callable[[], None]] = [
    all_reduce_norm,
    decode,
    mla,
    prefill,
    cache_write,
    fp8_kv_cache,
    moe,
    layers,
    lora,
    batch_invariant,
    quant,
    conv1d,
    gated_deltanet,
    mamba2,
]
