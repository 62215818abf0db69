"""The CPU kernels from Python. Every function builds the extension on its first call
(``build.load``); the arguments are checked in C++ (``csrc/``), a RuntimeError naming what is
wrong."""

from __future__ import annotations

import torch

from pagedllm.kernels.cpu.build import load


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store each token's K/V rows at its slot; slots < 0 are padding and are skipped; a slot past
    the cache is refused before anything is written. key, value: [num_tokens, num_kv_heads,
    head_size] (contiguous heads, any token stride); caches: [num_blocks, block_size,
    num_kv_heads, head_size], key's dtype; slot_mapping: [num_tokens] int64."""
    load()
    torch.ops.pagedllm_cpu.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


def paged_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> None:
    """Causal attention of every query token over its sequence's context in the paged cache,
    written into ``out``. Sequence ``s``'s queries are tokens ``[query_start_loc[s],
    query_start_loc[s + 1])``, its last ``query_len`` positions of ``seq_lens[s]``; a query at
    position ``p`` sees keys ``p - sliding_window < k <= p``.

    out, query: [num_tokens, num_heads, head_size] (contiguous heads, any token stride);
    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_size], the query's dtype;
    block_tables: [num_seqs, max_blocks] int32; seq_lens: [num_seqs] int32; query_start_loc:
    [num_seqs + 1] int32; alibi_slopes: [num_heads] (bias ``slope * (k - p)``). Tokens past
    ``query_start_loc[-1]`` are left as they are: passing the metadata of the first n sequences
    computes those alone.
    """
    load()
    torch.ops.pagedllm_cpu.paged_attention(
        out,
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        scale,
        sliding_window or 0,
        logits_soft_cap or 0.0,
        alibi_slopes,
    )


def int4_matmul_few_rows(
    x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor
) -> torch.Tensor:
    """``x W^T`` [M, N] bf16 for a weight packed by ``aten._convert_weight_to_int4pack_for_cpu``
    (uint8 [N, K / 2], N a multiple of 64) with its bf16 ``scales_and_zeros`` [K / 32, N, 2]:
    what ``aten._weight_int4pack_mm_for_cpu(x, packed, 32, scales_and_zeros)`` computes, read
    faster at one to four rows. x: bf16 [M, K], contiguous."""
    load()
    out = torch.empty(x.shape[0], packed.shape[0], dtype=torch.bfloat16)
    torch.ops.pagedllm_cpu.int4_matmul_few_rows(out, x, packed, scales_and_zeros)
    return out


def int4_prefill_supported() -> bool:
    """Whether ``int4_prefill_matmul`` runs here: oneDNN's brgemm ukernel with AMX bf16."""
    load()
    return bool(torch.ops.pagedllm_cpu.int4_prefill_supported())


def int4_prefill_matmul(
    x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor
) -> torch.Tensor:
    """``x W^T`` [M, N] bf16 for an ``int4_matmul_few_rows`` weight at prefill sizes: the weight
    decoded a tile of output rows at a time into AMX's VNNI layout, each tile one brgemm. x: bf16
    [M, K], rows contiguous. Needs ``int4_prefill_supported()``."""
    load()
    out = torch.empty(x.shape[0], packed.shape[0], dtype=torch.bfloat16)
    torch.ops.pagedllm_cpu.int4_prefill_matmul(out, x, packed, scales_and_zeros)
    return out


def int4_dequantize(
    packed: torch.Tensor, scales_and_zeros: torch.Tensor, start: int, end: int
) -> torch.Tensor:
    """Output rows [start, end) (multiples of 64) of an ``int4_matmul_few_rows`` weight as bf16
    [end - start, K]: ``q * scale + (zero - 8 scale)`` in float32, rounded once."""
    load()
    out = torch.empty(end - start, packed.shape[1] * 2, dtype=torch.bfloat16)
    torch.ops.pagedllm_cpu.int4_dequantize(out, packed, scales_and_zeros, start)
    return out


def argmax_logsumexp(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's first maximum and log-sum-exp, in one read of the logits: ([rows] int64,
    [rows] float32). logits: [num_rows, vocab] float32, rows contiguous."""
    load()
    argmax = torch.empty(logits.shape[0], dtype=torch.int64)
    logsumexp = torch.empty(logits.shape[0], dtype=torch.float32)
    torch.ops.pagedllm_cpu.argmax_logsumexp(logits, argmax, logsumexp)
    return argmax, logsumexp


def rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> None:
    """In place, in LlamaRMSNorm's rounding order: with ``residual``, ``residual <- x + residual``
    first; then ``x <- rms_norm(residual or x) * weight``. x, residual: [num_rows, hidden], rows
    contiguous; weight: [hidden], x's dtype."""
    load()
    torch.ops.pagedllm_cpu.rms_norm(x, residual, weight, eps)


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_size: int,
) -> None:
    """Rotate query and key in place by their tokens' positions (neox style), rounding as the
    PyTorch reference does. positions: [num_tokens] int64, rows of ``cos_sin_cache``
    ([max_position, head_size] of ``[cos | sin]``, the activations' dtype); query, key:
    [num_tokens, heads * head_size], rows contiguous."""
    load()
    torch.ops.pagedllm_cpu.rotary_embedding(positions, query, key, cos_sin_cache, head_size)
