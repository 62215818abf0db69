"""The CPU attention backend: a C++ kernel over the paged cache in place, else vectorised PyTorch.

Same cache layout as the torch reference (``[num_blocks, block_size, num_kv_heads, head_size]``
per layer, so the two share caches and swap code).

A step goes through ``pagedllm_cpu::paged_attention`` (kernels/cpu/csrc/paged_attention.cpp):
each work item (a token and its KV heads) reads its visible keys from the cache where they lie,
with an online softmax in float32, so there is no gathered copy, no mask and no per-sequence
Python; the cache write before it is one C++ call too (``reshape_and_cache``). One layer of C1's
decode step (32 sequences of ~100 tokens, bf16, 2 cores) spends ~0.15 ms in attention that way,
against ~0.57 ms in the PyTorch formulation below (benchmarks/RESULTS.md). Prefill chunks join
the same call while every context of the step is at most ``KERNEL_CHUNK_MAX_CONTEXT`` tokens and
no fresh prompt has ``SDPA_CAUSAL_MIN_TOKENS`` or more; past either, decodes take the kernel alone,
fresh prompts causal SDPA (its flash kernel's GEMM tiles, 4x the kernel at 1,000 tokens) and
chunks behind a cached prefix SDPA with a mask, whose tiles win behind long prefixes. The
kernel is built on first use; where it cannot be (no compiler), or with
``PAGEDLLM_CPU_KERNELS=0``, or for what it does not cover (attention sinks, a cache in another
dtype than the queries), everything takes the PyTorch formulation, computed the way a CPU is
fast at:

* Cache writes are one ``index_copy_`` per cache into its flattened ``[slots, kv_heads, head]``
  view (no boolean indexing, no dtype round trip).
* Decodes are computed together: one ``index_select`` of the blocks in the decodes' block tables
  (not a per-sequence gather), then two batched matmuls over ``[num_decodes, kv_heads, group,
  ctx]``. Folding the ``group = num_heads / num_kv_heads`` queries that share a KV head into the
  query-length axis means GQA costs no K/V expansion. For more than ``SDPA_MAX_DECODES`` decodes,
  matmul + softmax + matmul measured faster than SDPA's CPU kernel (0.4 against 0.5-1.5 ms a
  layer for 32 sequences of ~100 tokens, benchmarks/RESULTS.md); fewer decodes and prefill chunks
  use SDPA, whose flash kernel has the lower fixed cost and never materialises the
  ``query_len x ctx`` scores.
* A prefill chunk with no cached prefix attends over its own fresh K/V (no gather at all); a
  chunk behind a cached prefix gathers its context's blocks once.
* Everything stays in the run dtype (bf16 or float32); SDPA's CPU kernel accumulates in float32.
* One boolean mask per call, ``key_pos <= query_pos`` (and ``> query_pos - sliding_window``),
  which also removes every slot past ``seq_len``. Gathered slots past ``seq_len`` may hold
  anything, NaN included (``torch.empty`` caches): they are zeroed in the gathered copy, since a
  masked NaN would still poison the ``P @ V`` sums (0 * NaN = NaN).

Learned sinks (gpt-oss: a logit per head in every softmax's denominator, attending to nothing)
are not in the kernel nor in SDPA: a layer with them takes the explicit path, its softmax over the
scores and one more column.

ALiBi (Press et al., 2022: bias ``slope_h * (key_pos - query_pos)``) and logit soft-capping (Gemma
2: ``cap * tanh(score / cap)``) change the scores themselves, so with either one prefill chunks
also take the explicit path (matmul, cap, bias, mask, float32 softmax, matmul).

Attention sinks (StreamingLLM, Xiao et al. 2023) score the first ``attention_sinks`` keys with a
second query (``sink_query``) for the rows whose window has passed them, which SDPA cannot: a
layer with sinks always takes the explicit path, with one extra ``[rows, attention_sinks]``
matmul for the sink scores, selected into the first columns. Its mask keeps the sinks visible past
the window; the context between the sinks and the window may be freed blocks (NaN), so values no
row sees are zeroed.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from pagedllm.attention.backends.abstract import AttentionBackend, KVCache
from pagedllm.attention.backends.torch_backend import TorchAttentionBackend
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.kernels.cpu.build import available as cpu_kernels_available
from pagedllm.kernels.cpu.ops import paged_attention, reshape_and_cache
from pagedllm.platform import platform_for


def write_to_paged_cache_indexed(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store each token's K/V at its slot with ``index_copy_``; slots < 0 (padding) are skipped.

    key, value: [num_tokens, num_kv_heads, head_size]; caches: [num_blocks, block_size,
    num_kv_heads, head_size]; slot_mapping: [num_tokens] int64.
    """
    if bool((slot_mapping < 0).any()):  # a host check: this backend runs on the CPU
        valid = slot_mapping >= 0
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    num_kv_heads, head_size = key_cache.shape[2:]
    key_cache.view(-1, num_kv_heads, head_size).index_copy_(0, slot_mapping, key.to(key_cache.dtype))
    value_cache.view(-1, num_kv_heads, head_size).index_copy_(0, slot_mapping, value.to(value_cache.dtype))


def gather_contexts(cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """The contexts of ``seq_lens.shape[0]`` sequences, one index_select of their blocks:
    [num_seqs, num_kv_heads, num_blocks * block_size, head_size], contiguous (what batched
    matmuls read fastest), slots past each ``seq_len`` zeroed (they may hold NaN).

    block_tables: [num_seqs, num_blocks] int32; seq_lens: [num_seqs] (host).
    """
    num_seqs, num_blocks = block_tables.shape
    _, block_size, num_kv_heads, head_size = cache.shape
    ctx_len = num_blocks * block_size
    blocks = cache.index_select(0, block_tables.reshape(-1).long())
    past_end = (torch.arange(ctx_len) >= seq_lens[:, None]).view(-1).nonzero().view(-1)
    blocks.view(num_seqs * ctx_len, -1).index_fill_(0, past_end, 0)
    return blocks.view(num_seqs, ctx_len, num_kv_heads, head_size).transpose(1, 2).contiguous()


# Prefill chunks take the kernel too while no context of the step is longer than this: the whole
# step is then one call, with no per-sequence Python. Against SDPA with a mask, fresh prompts of
# every length measured ran faster through it (bf16, 2 cores, a layer of SmolLM2: C1's 32 prompts
# of ~36 tokens 0.5 against 2.9 ms; one of 2,048 tokens 60 against 63), and so did chunks behind
# a short cached prefix; behind 2,000-4,000 cached tokens SDPA's GEMM tiles win by 10-20%
# (benchmarks/RESULTS.md). Causal SDPA, without a mask, beats it on long fresh prompts (below).
KERNEL_CHUNK_MAX_CONTEXT = 2048

# A step with a fresh prompt (no cached prefix) of at least this many tokens is split: decodes
# and chunks behind a prefix as before, each fresh prompt by SDPA with ``is_causal``. Its keys are
# then the chunk's own, in order, so SDPA needs no mask, its flash kernel skips the tiles above the
# diagonal and computes in GEMM tiles, and ``enable_gqa`` reads each KV head once for its group;
# the kernel walks each token's keys with vector code. Measured on the development CPU (SmolLM2's
# 9 query / 3 KV heads of 64, bf16, one thread, one layer; benchmarks/cpu_prefill_attention.py):
# 64 tokens 0.11 against 0.18 ms, 1,000 tokens 12.4 against 51.6, 2,048 tokens 27.7 against 218.
# Below it a whole step stays one kernel call: many short prompts (C1's 32 of ~36 tokens) cost
# more as one SDPA call each.
SDPA_CAUSAL_MIN_TOKENS = 64

# Up to this many decodes SDPA's fused kernel wins (its fixed cost is lower); past it, two batched
# matmuls do (measured crossover between 8 and 16 sequences of ~128 tokens, bf16, 2 cores).
SDPA_MAX_DECODES = 8


class CpuAttentionBackend(AttentionBackend):
    name = "cpu"
    # Fresh prompts of SDPA_CAUSAL_MIN_TOKENS or more by causal SDPA (off where it cannot apply).
    causal_prefill = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """AttentionBackend's arguments."""
        super().__init__(*args, **kwargs)
        # [num_heads] float32 for the kernel.
        slopes = self.alibi_slopes
        self.kernel_alibi_slopes = None if slopes is None else slopes.float().contiguous()
        # [num_kv_heads, group, 1, 1]: query head h = kv_head * group + g, as the model lays them out.
        self.alibi_slopes = (
            None
            if self.alibi_slopes is None
            else self.alibi_slopes.view(self.num_kv_heads, self.num_queries_per_kv, 1, 1)
        )
        self.use_kernel = self.attention_sinks == 0 and self.sinks is None and cpu_kernels_available()
        # A fresh prompt by causal SDPA where nothing edits the scores or narrows the keys.
        self.causal_prefill = self.causal_prefill and not (
            self.attention_sinks
            or self.sinks is not None
            or self.sliding_window is not None
            or slopes is not None
            or self.logits_soft_cap is not None
        )

    # The reference's layout: caches, swaps and tests are shared with it.
    get_kv_cache_shape = TorchAttentionBackend.get_kv_cache_shape

    @classmethod
    def check_supported(
        cls, head_size: int, block_size: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        if not platform_for(device).is_cpu():
            raise ValueError(f"attention_backend 'cpu' runs on the CPU only, got device {str(device)!r}")

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: KVCache,
        attn_metadata: AttentionMetadata,
        sink_query: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        sink_query = self._check_sink_query(query, sink_query) if self.attention_sinks else None
        query, key = self.rotate(positions, query, key)
        key_cache, value_cache = kv_cache
        md = attn_metadata
        kernel = self.use_kernel and sink_query is None and key_cache.dtype == query.dtype
        if kernel:
            reshape_and_cache(key, value, key_cache, value_cache, md.slot_mapping)
        else:
            write_to_paged_cache_indexed(key, value, key_cache, value_cache, md.slot_mapping)
        num_decodes = md.num_decodes
        whole_step = kernel and md.max_seq_len <= KERNEL_CHUNK_MAX_CONTEXT
        if whole_step and not (self.causal_prefill and self._long_fresh_prompt(md)):  # one call
            return self._kernel(query, key_cache, value_cache, md, md.num_seqs)
        if num_decodes == query.shape[0]:  # decodes only, no padding tokens: no output copy
            return self._decode(query, sink_query, key_cache, value_cache, md, kernel)
        output = torch.empty_like(query)
        if num_decodes:
            decode_sinks = None if sink_query is None else sink_query[:num_decodes]
            decodes = query[:num_decodes]
            output[:num_decodes] = self._decode(decodes, decode_sinks, key_cache, value_cache, md, kernel)
        query_start_loc = md.query_start_loc_cpu.tolist()
        for i in range(num_decodes, md.num_seqs):
            start, end = query_start_loc[i], query_start_loc[i + 1]
            output[start:end] = self._prefill(query, key, value, key_cache, value_cache, md, i, sink_query)
        return output

    @staticmethod
    def _long_fresh_prompt(md: AttentionMetadata) -> bool:
        """Whether a prefill chunk of the step is a whole prompt of SDPA_CAUSAL_MIN_TOKENS or more
        (asked by every layer: decode steps and short chunks answer from ``max_query_len``)."""
        if md.max_query_len < SDPA_CAUSAL_MIN_TOKENS:
            return False
        prefills = slice(md.num_decodes, md.num_seqs)
        query_lens = np.diff(md.query_start_loc_cpu.numpy())[prefills]
        fresh = query_lens == md.seq_lens_cpu.numpy()[prefills]
        return bool(((query_lens >= SDPA_CAUSAL_MIN_TOKENS) & fresh).any())

    def _prefill(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        md: AttentionMetadata,
        i: int,
        sink_query: torch.Tensor | None,
    ) -> torch.Tensor:
        """Sequence i's chunk of queries by SDPA (or the explicit path): [query_len, heads, head]."""
        start, end = int(md.query_start_loc_cpu[i]), int(md.query_start_loc_cpu[i + 1])
        q = query[start:end].transpose(0, 1)[None]  # [1, num_heads, query_len, head_size]
        if end - start == int(md.seq_lens_cpu[i]):  # no cached prefix: the context is this step's K/V
            k, v = key[start:end].transpose(0, 1)[None], value[start:end].transpose(0, 1)[None]
            if self.causal_prefill:  # fewer tokens too, once the step is split
                out = F.scaled_dot_product_attention(
                    q, k, v, is_causal=True, scale=self.scale, enable_gqa=True
                )
                return out[0].transpose(0, 1)
        else:
            k, v = self._gather(key_cache, value_cache, md, i, i + 1)
        sq = None if sink_query is None else sink_query[start:end].transpose(0, 1)[None]
        return self._attend(q, k, v, md.seq_lens_cpu[i : i + 1], sq)[0].transpose(0, 1)

    def _kernel(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        md: AttentionMetadata,
        num_seqs: int,
    ) -> torch.Tensor:
        """The tokens of the step's first ``num_seqs`` sequences through the C++ kernel, into a
        tensor of the query's shape (rows past those sequences' tokens are left unwritten)."""
        output = torch.empty_like(query)
        paged_attention(
            output,
            query,
            key_cache,
            value_cache,
            md.block_tables[:num_seqs],
            md.seq_lens_cpu[:num_seqs],
            md.query_start_loc_cpu[: num_seqs + 1],
            self.scale,
            self.sliding_window,
            self.logits_soft_cap,
            self.kernel_alibi_slopes,
        )
        return output

    def _decode(
        self,
        query: torch.Tensor,
        sink_query: torch.Tensor | None,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        md: AttentionMetadata,
        kernel: bool,
    ) -> torch.Tensor:
        """query (and sink_query, None without sinks): [num_decodes, num_heads, head_size], one
        token per sequence -> same shape; ``kernel``: through the C++ kernel."""
        num_decodes = query.shape[0]
        if kernel:
            return self._kernel(query, key_cache, value_cache, md, num_decodes)
        if (
            num_decodes == 1
            and sink_query is None
            and self.sinks is None
            and self.alibi_slopes is None
            and self.logits_soft_cap is None
        ):
            return self._decode_one(query, key_cache, value_cache, md)
        keys, values = self._gather(key_cache, value_cache, md, 0, num_decodes)
        sinks = None if sink_query is None else sink_query[:, :, None]
        out = self._attend(query[:, :, None], keys, values, md.seq_lens_cpu[:num_decodes], sinks)
        return out.view(num_decodes, self.num_heads, self.head_size)

    def _decode_one(
        self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, md: AttentionMetadata
    ) -> torch.Tensor:
        """One stream's decode: its query is the last position, so every slot of its window
        [seq_len - sliding_window, seq_len) is visible and SDPA needs no mask. The window is a
        slice of the gathered blocks, passed strided: no zeroing of the slots past its end, no
        mask, no contiguous copy (the batched path's small ops cost ~3 ms of a one-stream step).
        query: [1, num_heads, head_size]."""
        seq_len = int(md.seq_lens_cpu[0])
        block_size, num_kv_heads, head_size = key_cache.shape[1:]
        first = 0 if self.sliding_window is None else max(0, seq_len - self.sliding_window)
        table = md.block_tables[0, first // block_size : -(-seq_len // block_size)]
        start, end = first % block_size, first % block_size + seq_len - first

        def window(cache: torch.Tensor) -> torch.Tensor:  # [1, num_kv_heads, window, head_size]
            slots = cache.index_select(0, table).view(-1, num_kv_heads, head_size)[start:end]
            return slots.transpose(0, 1)[None]

        # The group of queries that share a KV head folded into SDPA's query axis (as _attend).
        q = query.to(key_cache.dtype).view(1, num_kv_heads, self.num_queries_per_kv, head_size)
        out = F.scaled_dot_product_attention(q, window(key_cache), window(value_cache), scale=self.scale)
        return out.view(1, self.num_heads, head_size).to(query.dtype)

    @staticmethod
    def _gather(
        key_cache: torch.Tensor, value_cache: torch.Tensor, md: AttentionMetadata, first: int, end: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Contexts of sequences [first, end): (keys, values), each [n, kv_heads, ctx, head]."""
        seq_lens = md.seq_lens_cpu[first:end]
        num_blocks = -(-int(seq_lens.max()) // key_cache.shape[1])
        table = md.block_tables[first:end, :num_blocks]
        return gather_contexts(key_cache, table, seq_lens), gather_contexts(value_cache, table, seq_lens)

    def _attend(
        self,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        seq_lens: torch.Tensor,
        sink_query: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Each sequence's queries are the last ``query_len`` positions of its ``seq_lens[b]``.

        query (and sink_query, None without sinks): [num_seqs, num_heads, query_len, head_size];
        keys, values: [num_seqs, num_kv_heads, ctx_len, head_size] (ctx_len >= every seq_len;
        slots past it are ignored). Returns [num_seqs, num_heads, query_len, head_size].
        """
        num_seqs, _, query_len, head_size = query.shape
        group, ctx_len = self.num_queries_per_kv, keys.shape[2]
        key_pos = torch.arange(ctx_len)
        query_pos = seq_lens.long()[:, None] - query_len + torch.arange(query_len)  # [num_seqs, query_len]
        mask = key_pos <= query_pos[:, :, None]  # [num_seqs, query_len, ctx_len]
        sink_mask = None
        if self.sliding_window is not None:
            in_window = key_pos > query_pos[:, :, None] - self.sliding_window
            if sink_query is not None:
                # The sinks each row's window has passed (k <= q - window < q: causal too).
                sink_mask = ~in_window[:, :, : self.attention_sinks]
                mask &= in_window | (key_pos < self.attention_sinks)
                # Keys no row sees may be freed blocks holding NaN: zero their values (a masked
                # probability is 0, and 0 * NaN = NaN); their scores are masked below.
                values = torch.where(mask.any(dim=1)[:, None, :, None], values, 0)
            else:
                mask &= in_window

        def fold(q: torch.Tensor) -> torch.Tensor:
            # Fold each KV head's query group into the query axis: [num_seqs, kv_heads,
            # group * query_len, head]. (A cache in another dtype than the activations computes in
            # the cache's.)
            return q.to(keys.dtype).reshape(num_seqs, self.num_kv_heads, group * query_len, head_size)

        def fold_mask(m: torch.Tensor) -> torch.Tensor:
            if query_len == 1:  # one mask row per sequence, broadcast over the group
                return m[:, None]
            return m[:, None, None].expand(-1, 1, group, -1, -1).reshape(num_seqs, 1, group * query_len, -1)

        q, mask = fold(query), fold_mask(mask)
        few_rows = query_len > 1 or num_seqs <= SDPA_MAX_DECODES
        if sink_query is not None:
            sinks = (fold(sink_query), fold_mask(sink_mask))
            out = self._attend_explicit(q, keys, values, mask, query_pos, key_pos, sinks)
        elif few_rows and self.alibi_slopes is None and self.logits_soft_cap is None and self.sinks is None:
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scale)
        else:
            out = self._attend_explicit(q, keys, values, mask, query_pos, key_pos)
        return out.view(num_seqs, self.num_heads, query_len, head_size).to(query.dtype)

    def _attend_explicit(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        mask: torch.Tensor,
        query_pos: torch.Tensor,
        key_pos: torch.Tensor,
        sinks: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Scores by matmul (in the run dtype), then cap, bias, mask and a float32 softmax; shapes as
        in SDPA. Masking replaces the scores, so NaN-free keys are not needed here.

        sinks: (sink_q like q, sink_mask [num_seqs, 1, rows, n <= attention_sinks]): the first n
        scores of the rows whose window has passed those keys come from sink_q instead."""
        num_seqs, num_kv_heads, rows, ctx_len = mask.shape[0], q.shape[1], q.shape[2], key_pos.shape[0]
        scores = torch.matmul(q, keys.transpose(-1, -2)).float() * self.scale
        if sinks is not None:
            sink_q, sink_mask = sinks
            num_sinks = sink_mask.shape[-1]
            sink_scores = torch.matmul(sink_q, keys[:, :, :num_sinks].transpose(-1, -2)).float() * self.scale
            scores[..., :num_sinks] = torch.where(sink_mask, sink_scores, scores[..., :num_sinks])
        if self.logits_soft_cap is not None:
            scores = self.logits_soft_cap * torch.tanh(scores / self.logits_soft_cap)
        if self.alibi_slopes is not None:
            distance = (key_pos - query_pos[:, :, None]).float()  # [num_seqs, query_len, ctx_len]
            bias = self.alibi_slopes * distance[:, None, None]  # [num_seqs, kv_heads, group, query_len, ctx]
            scores = scores + bias.view(num_seqs, num_kv_heads, rows, ctx_len)
        scores = scores.masked_fill_(~mask, float("-inf"))
        if self.sinks is None:
            probs = torch.softmax(scores, dim=-1)
        else:
            # The learned sinks: one more logit per row (row g * query_len + i is head kv * group + g).
            query_len = rows // self.num_queries_per_kv
            sink = self.sinks.float().view(num_kv_heads, -1, 1).repeat_interleave(query_len, 1)
            sink = sink.expand(num_seqs, -1, -1, -1)  # [num_seqs, kv_heads, rows, 1]
            probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
        return torch.matmul(probs.to(values.dtype), values)


class CpuInvariantAttentionBackend(CpuAttentionBackend):
    """``batch_invariant=True`` on the CPU: no causal SDPA, whose tiles would sum a whole prompt
    otherwise than its chunks. Prompts stay in the kernel, whose per-token sums do not depend on
    where a chunk starts, so a prompt prefilled whole, in chunks or behind a cached prefix, and a
    token decoded or scored later, get the same bits."""

    causal_prefill = False
