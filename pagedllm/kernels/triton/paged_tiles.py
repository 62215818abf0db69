"""The inner loop both paged attention kernels share: online softmax over tiles of paged K/V.

Algorithm (FlashAttention-2's forward, Dao 2023, in the base-2 form of Triton's fused-attention
tutorial): for a tile of ``ROWS`` query rows (the heads of one GQA group for decode, ``BLOCK_M``
tokens of one head for prefill) and context tokens ``[lo, hi)``, walk the context ``BLOCK_N``
tokens at a time::

    s     = (q @ k^T) * scale * log2(e)        # [ROWS, BLOCK_N] float32
    m_new = max(m_i, rowmax(s))
    p     = exp2(s - m_new);  alpha = exp2(m_i - m_new)
    l_i   = l_i * alpha + rowsum(p)
    acc   = acc * alpha + p @ v                # [ROWS, HEAD_DIM] float32
    m_i   = m_new

so the final output is ``acc / l_i`` and ``m_i`` is the row max in log2 units. Folding log2(e) into
the scale turns every exponential into one ``exp2`` instruction.

Paging: token ``n`` of a sequence lives in physical block ``block_table[n // BLOCK_SIZE]`` at
position ``n % BLOCK_SIZE``. A ``BLOCK_N``-token tile therefore gathers ``BLOCK_N / BLOCK_SIZE``
whole cache blocks, loaded as ``[BLOCK_N, HEAD_DIM]`` rows: row ``slot`` of a block starts at
``block * stride_block + slot * stride_slot`` and its ``head_size`` elements sit at the caller's
``k_dim_offs`` / ``v_dim_offs`` from there, which is how one loop reads both cache layouts (see
``PagedKVLayout``). With the Triton backend's ``[num_blocks, num_kv_heads, block_size, head_size]``
each block is one contiguous ``block_size * head_size`` run and the offsets are ``0, 1, ...``
(16-byte vector loads). ``HEAD_DIM`` is ``head_size`` rounded up to a power of two, the padding
columns masked to zero so they add nothing to ``q @ k^T`` or the output.

Variants (each a constexpr switch, so the plain kernels compile as before): a logit soft cap
(``s = cap * tanh(s / cap)``, Gemma 2), ALiBi (``s += slope * (key_pos - q_pos)``, Press et al.
2022) and a sliding window (row ``r`` sees keys ``> q_pos[r] - sliding_window``, Hugging Face's
convention). The callers start the loop at the window's first tile, so a windowed layer reads only
the window's blocks.

Attention sinks (StreamingLLM, Xiao et al. 2023) are one more call of this loop per program, over
the tile(s) of keys ``[0, attention_sinks)`` with the *sink query* as ``q``; with SINK the loop
keeps, per row, only the keys its window has passed (``<= q_pos[r] - sliding_window``: the exact
complement of WINDOW's mask, so the sink stage and the window stages never score a (row, key)
twice). The running state carries across calls, so the softmax is one over the union.

An FP8 cache (KV_FP8, vLLM's ``kv_cache_dtype="fp8"``) holds ``k / k_scale`` and ``v / v_scale`` in
float8_e4m3fn: tiles widen to the query's dtype on load (exact), ``k_scale`` rides in ``qk_scale``
(``fp8_kv_scales``) and ``v_scale`` scales ``p`` before ``p @ v``. Half the bytes per tile, the
same FLOPs. A bf16 model's dots then run in fp16 (the callers load q as fp16): Hopper widens e4m3
to fp16 in one instruction per two values, to bf16 only through fp16 (three per two), which at
the HBM rate is more conversion than the SM issues. fp16 holds bf16 queries exactly (|q| within
its range, 6e-5 to 65504; smaller components lose bits, not magnitude) and the probabilities
more finely.

Context parallelism (``CP_SIZE = P > 1``; Striped Attention, Brandon et al. 2023): a rank ``r``
holds the keys at global positions ``t = j * P + r`` at *local* index ``j`` of its block table. The
loop walks local indices (``lo``, ``hi``, ``kv_lo`` and the paging are local), while the masks and
ALiBi compare global positions: key ``j`` is at ``j * P + r`` and ``q_pos`` stays global.
``local_key_count`` turns a global bound into a local one. With ``CP_SIZE = 1`` the key position is
the index itself and the loop compiles as it did before context parallelism.

Without WINDOW or SINK, every row must see at least one unmasked key in the first tile it processes
(otherwise ``exp2(-inf - -inf)`` is NaN); the callers guarantee it. With WINDOW or SINK, a causal
stage under context parallelism (query position 0 sees no key on rank 1), or EMPTY_ROWS (a decode
partition past some of a request's verified tokens: ``paged_decode``'s query groups), a fully masked
row keeps ``m_i = -inf, l_i = 0`` until it meets its first visible key.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@triton.jit
def attend_paged_range(
    state,  # (acc, l_i, m_i): the running state, [ROWS, HEAD_DIM], [ROWS], [ROWS] float32
    rows,  # (q, q_pos): [ROWS, HEAD_DIM] queries in the compute dtype (compute_dtype), padding
    # columns zero; [ROWS] each row's context position (read when CAUSAL, WINDOW, SINK or ALIBI)
    lo,
    hi,  # the context tokens [lo, hi) to attend to
    kv_lo,  # with MASK_TAIL, tokens < kv_lo are masked too (pass lo when none are)
    cache,  # (keys, values, block_table) of this program's KV head and sequence: see below
    scores,  # (qk_scale, v_scale, sliding_window, soft_cap, alibi_row, cp_rank): see below
    CONFIG: tl.constexpr,  # the kernel's shape and variants: see below
    MASK_TAIL: tl.constexpr,  # the range's ends may fall inside a tile: mask tokens outside [kv_lo, hi)
    CAUSAL: tl.constexpr = False,  # mask keys past each row's q_pos
    WINDOW: tl.constexpr = False,  # mask keys at or before each row's q_pos - sliding_window
    SINK: tl.constexpr = False,  # the opposite: mask keys after q_pos - sliding_window (in the window)
    CP_SIZE: tl.constexpr = 1,  # context-parallel ranks: local key j is at j * CP_SIZE + cp_rank
    EMPTY_ROWS: tl.constexpr = False,  # a CAUSAL row may see no key of the range (see the docstring)
):
    """One stage of the online softmax: ``state`` updated with the keys [lo, hi). The arguments
    every stage of a program shares travel as tuples (Triton inlines the call: the same code)::

        cache:  keys        (key cache base offset to the program's KV head, block stride, slot
                            stride, [HEAD_DIM] offsets of a key row's elements from its slot:
                            dim_offsets)
                values      the same for the value cache
                block_table (the sequence's block table row, its block stride)
        scores: qk_scale       softmax scale * log2(e) (times k_scale with KV_FP8: fp8_kv_scales)
                v_scale        read when KV_FP8: the value cache's scale
                sliding_window read when WINDOW or SINK: row r's window holds keys > q_pos[r] - it
                soft_cap       read when SOFT_CAP: the cap * log2(e)
                alibi_row      [ROWS] ALiBi slope of each row * log2(e), read when ALIBI
                cp_rank        read when CP_SIZE > 1: this rank's stripe (local key j at j * P + r)
        CONFIG: HEAD_SIZE, HEAD_DIM, BLOCK_SIZE, BLOCK_N; SOFT_CAP, ALIBI (the variants),
                DOT_PRECISION (dot_precision), KV_FP8 (the caches hold float8_e4m3fn; q is in
                the compute dtype)
    """
    acc, l_i, m_i = state
    q, q_pos = rows
    keys, values, block_table = cache
    block_table_ptr, stride_bt_blk = block_table
    qk_scale, v_scale, sliding_window, soft_cap, alibi_row, cp_rank = scores
    HEAD_SIZE: tl.constexpr = CONFIG[0]
    HEAD_DIM: tl.constexpr = CONFIG[1]
    BLOCK_SIZE: tl.constexpr = CONFIG[2]
    BLOCK_N: tl.constexpr = CONFIG[3]
    SOFT_CAP: tl.constexpr = CONFIG[4]
    ALIBI: tl.constexpr = CONFIG[5]
    DOT_PRECISION: tl.constexpr = CONFIG[6]
    KV_FP8: tl.constexpr = CONFIG[7]
    offs_d = tl.arange(0, HEAD_DIM)
    dim_mask = offs_d < HEAD_SIZE
    if not MASK_TAIL:
        # Full tiles (the bulk of a long context) load their block numbers one tile ahead: a
        # tile's K and V addresses then never wait on a block-table load issued in the same
        # iteration. On an H200, K1 at 4,096 tokens in 1,024-token partitions went from 291.5 to
        # 272.7 us, and at 16,384 tokens in 4,096-token partitions from 1,061.8 to 975.0 us.
        ahead = lo + tl.arange(0, BLOCK_N)
        next_block_ids = tl.load(
            block_table_ptr + (ahead // BLOCK_SIZE) * stride_bt_blk, mask=ahead < hi, other=0
        )
    for tile_start in range(lo, hi, BLOCK_N):
        offs_n = tile_start + tl.arange(0, BLOCK_N)
        if MASK_TAIL:
            token_mask = (offs_n >= kv_lo) & (offs_n < hi)
            block_ids = tl.load(
                block_table_ptr + (offs_n // BLOCK_SIZE) * stride_bt_blk, mask=token_mask, other=0
            )
            kv_mask = token_mask[:, None] & dim_mask[None, :]
        else:
            # No per-token predicate on K and V (the range holds whole tiles).
            block_ids = next_block_ids
            ahead = offs_n + BLOCK_N
            next_block_ids = tl.load(
                block_table_ptr + (ahead // BLOCK_SIZE) * stride_bt_blk, mask=ahead < hi, other=0
            )
            kv_mask = dim_mask[None, :]
        # int64: block * stride_block overflows int32 for caches past 2^31 elements.
        block_ids = block_ids.to(tl.int64)
        slots = offs_n % BLOCK_SIZE
        # In a masked tile the mask also keeps whatever the slots outside [kv_lo, hi) hold (stale
        # values, NaN) out of the dots.
        k = _load_rows(keys, block_ids, slots, kv_mask)
        if KV_FP8:
            k = k.to(q.dtype)  # exact: e4m3 widens to bf16, fp16 and fp32 without rounding
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        if SOFT_CAP:
            # cap * tanh(s / cap) in log2 units: both s and the cap carry the factor log2(e).
            s = soft_cap * _tanh(s / soft_cap)
        key_pos = offs_n  # the keys' global positions, which the masks and ALiBi compare
        if CP_SIZE > 1:
            key_pos = offs_n * CP_SIZE + cp_rank
        if ALIBI:
            s += alibi_row[:, None] * (key_pos[None, :] - q_pos[:, None]).to(tl.float32)
        if MASK_TAIL:
            s = tl.where(token_mask[None, :], s, float("-inf"))
        if CAUSAL:
            s = tl.where(key_pos[None, :] <= q_pos[:, None], s, float("-inf"))
        if WINDOW:
            s = tl.where(key_pos[None, :] > q_pos[:, None] - sliding_window, s, float("-inf"))
        if SINK:
            s = tl.where(key_pos[None, :] <= q_pos[:, None] - sliding_window, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_ref = m_new
        if WINDOW or SINK or EMPTY_ROWS or (CAUSAL and CP_SIZE > 1):
            # A row may see no key of a tile its neighbours need: subtract 0, not -inf, so that
            # its p and alpha are exp2(-inf) = 0 instead of exp2(-inf - -inf) = NaN.
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_ref[:, None])
        alpha = tl.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_rows(values, block_ids, slots, kv_mask)
        if KV_FP8:
            # (p * v_scale) @ v_fp8 = p @ (v_fp8 * v_scale): the scale on the [ROWS, BLOCK_N]
            # probabilities, not the [BLOCK_N, HEAD_DIM] tile; l_i keeps the unscaled p.
            v = v.to(q.dtype)
            p = p * v_scale
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def window_start_of(seq_len, sliding_window):
    """The first key a sequence's last token sees: seq_len - sliding_window (0 without a window)."""
    return tl.maximum(seq_len - sliding_window, 0) * (sliding_window > 0)


@triton.jit
def local_key_count(num_global, cp_rank, CP_SIZE: tl.constexpr):
    """How many of the global positions [0, num_global) (num_global >= 0) this rank holds: those
    ``t = j * CP_SIZE + cp_rank``, i.e. ``ceil((num_global - cp_rank) / CP_SIZE)`` clipped at 0
    (the numerator below is >= 0, so ``//`` is a floor). Monotone in num_global, so a global bound
    ``min(a, b)`` maps to ``min(local(a), local(b))``. num_global itself with CP_SIZE 1."""
    if CP_SIZE > 1:
        num_global = (num_global - cp_rank + CP_SIZE - 1) // CP_SIZE
    return num_global


@triton.jit
def row_lse(l_i, m_i):
    """Each row's natural log of its softmax denominator from the running state (m_i in log2
    units): ``(m_i + log2(l_i)) * ln(2)``; -inf for a row that saw no key (m_i = -inf, l_i = 0)."""
    return (m_i + tl.log2(l_i)) * 0.6931471805599453


@triton.jit
def _load_rows(cache, block_ids, slots, mask):
    """The [BLOCK_N, HEAD_DIM] rows of one paged cache (``attend_paged_range``'s keys or values)
    at (block_ids [BLOCK_N] int64, slots [BLOCK_N]); masked elements read 0."""
    head_ptr, stride_block, stride_slot, dim_offs = cache
    return tl.load(
        head_ptr + block_ids[:, None] * stride_block + slots[:, None] * stride_slot + dim_offs[None, :],
        mask=mask,
        other=0.0,
    )


@triton.jit
def fp8_kv_scales(qk_scale, k_scale_ptr, v_scale_ptr, KV_FP8: tl.constexpr):
    """(qk_scale, v_scale) for ``attend_paged_range``: with an FP8 cache, k_scale (a device
    scalar, so a CUDA graph reads the loaded value) folded into the score scale, since
    ``q . (k * k_scale) = (q . k) * k_scale``; without one, as they are and 1.0 (unread)."""
    v_scale = 1.0
    if KV_FP8:
        qk_scale = qk_scale * tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)
    return qk_scale, v_scale


@triton.jit
def _tanh(x):
    """tanh from one exp2 of a non-positive argument (no overflow, no cancellation for large |x|)."""
    e = tl.exp2(-2.885390081777927 * tl.abs(x))  # exp(-2|x|); 2.885... = 2 * log2(e)
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def dim_offsets(offs_d, stride_chunk, stride_dim, CHUNK: tl.constexpr):
    """Offsets of a row's elements ``offs_d`` from the row's start: runs of ``CHUNK`` contiguous
    elements ``stride_chunk`` apart (vLLM's original K, ``CHUNK = x``), or, with ``CHUNK = 0``, one
    run of stride ``stride_dim`` (every other layout: no division on the common path)."""
    if CHUNK == 0:
        offs = offs_d * stride_dim
    else:
        offs = (offs_d // CHUNK) * stride_chunk + (offs_d % CHUNK) * stride_dim
    return offs


@dataclass(frozen=True)
class PagedKVLayout:
    """Where a pair of paged caches keeps element ``d`` of slot ``s`` of KV head ``h`` in block ``b``::

        K: b * kb + h * kh + s * ks + (d // key_chunk) * kc + (d % key_chunk) * kd   (key_chunk 0: d * kd)
        V: b * vb + h * vh + s * vs + d * vd

    with ``key_strides = (kb, kh, ks, kc, kd)`` and ``value_strides = (vb, vh, vs, vd)``. Two layouts
    have this form: the Triton backend's (K and V both ``[num_blocks, num_kv_heads, block_size,
    head_size]``, ``key_chunk = 0``) and vLLM's original (K ``[num_blocks, num_kv_heads, head_size / x,
    block_size, x]``, ``key_chunk = x``; V ``[num_blocks, num_kv_heads, head_size, block_size]``,
    ``vs = 1``, ``vd = block_size``), told apart by the key cache's rank.
    """

    num_kv_heads: int
    block_size: int
    head_size: int
    key_strides: tuple[int, int, int, int, int]
    key_chunk: int
    value_strides: tuple[int, int, int, int]

    @staticmethod
    def of(key_cache: torch.Tensor, value_cache: torch.Tensor) -> PagedKVLayout:
        assert key_cache.dtype == value_cache.dtype, f"{key_cache.dtype} != {value_cache.dtype}"
        kb, kh, *k_rest = key_cache.stride()
        vb, vh, *v_rest = value_cache.stride()
        if key_cache.dim() == 4:
            assert key_cache.shape == value_cache.shape, (
                f"caches {tuple(key_cache.shape)} / {tuple(value_cache.shape)}: want [num_blocks, "
                "num_kv_heads, block_size, head_size]"
            )
            _, num_kv_heads, block_size, head_size = key_cache.shape
            ks, kd = k_rest
            vs, vd = v_rest
            return PagedKVLayout(
                num_kv_heads, block_size, head_size, (kb, kh, ks, 0, kd), 0, (vb, vh, vs, vd)
            )
        assert key_cache.dim() == 5 and value_cache.dim() == 4, (
            f"caches {tuple(key_cache.shape)} / {tuple(value_cache.shape)}: want K [num_blocks, "
            "num_kv_heads, head_size / x, block_size, x] and V [num_blocks, num_kv_heads, head_size, "
            "block_size]"
        )
        num_blocks, num_kv_heads, num_chunks, block_size, x = key_cache.shape
        head_size = num_chunks * x
        assert value_cache.shape == (num_blocks, num_kv_heads, head_size, block_size), (
            f"value_cache {tuple(value_cache.shape)} does not match key_cache {tuple(key_cache.shape)}"
        )
        kc, ks, kd = k_rest
        vd, vs = v_rest
        key_strides = (kb, kh, ks, kc, kd)
        return PagedKVLayout(num_kv_heads, block_size, head_size, key_strides, x, (vb, vh, vs, vd))


def compute_dtype(query: torch.Tensor, key_cache: torch.Tensor) -> torch.dtype:
    """The dtype of the kernels' dot products: the cache's, or the query's for an FP8 cache
    (whose tiles widen to it)."""
    return query.dtype if key_cache.dtype == torch.float8_e4m3fn else key_cache.dtype


def fp8_scale_args(
    query: torch.Tensor, key_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None
) -> tuple[bool, tuple[torch.Tensor, torch.Tensor]]:
    """(KV_FP8, the kernel's k_scale and v_scale pointers). An FP8 cache needs both scales,
    float32 scalars on the device (read by the kernel, so a CUDA graph sees loaded values); any
    other cache gets a pointer that is never read."""
    if key_cache.dtype != torch.float8_e4m3fn:
        return False, (query, query)
    assert k_scale is not None and v_scale is not None, "an FP8 cache needs k_scale and v_scale"
    for scale in (k_scale, v_scale):
        assert scale.dtype == torch.float32 and scale.numel() == 1 and scale.device == query.device, (
            f"scale {scale.dtype} {tuple(scale.shape)} on {scale.device}: want one float32 on {query.device}"
        )
    assert query.dtype in (torch.float16, torch.bfloat16, torch.float32), f"query dtype {query.dtype}"
    return True, (k_scale, v_scale)


def check_partial_inputs(
    query: torch.Tensor, lse: torch.Tensor | None, cp_rank: int, cp_world_size: int, has_sinks: bool
) -> None:
    """What a partial launch (``lse`` given) and a context-parallel one (``cp_world_size > 1``)
    assume: lse [num_tokens, num_heads] float32 with unit head stride; rank in [0, P); no sinks of
    either kind in a partial launch (context parallelism refuses those layers)."""
    assert cp_world_size >= 1 and 0 <= cp_rank < cp_world_size, f"cp_rank {cp_rank} of {cp_world_size}"
    if lse is not None:
        assert lse.dtype == torch.float32 and lse.shape == query.shape[:2] and lse.stride(1) == 1, (
            f"lse {lse.dtype} {tuple(lse.shape)}: want float32 {tuple(query.shape[:2])}"
        )
    assert cp_world_size == 1 or lse is not None, "a context-parallel launch is partial: it needs lse"
    assert lse is None or not has_sinks, "a partial launch does not take sinks (merging would repeat them)"


def dot_precision(is_float32: bool) -> str:
    """tl.dot's input precision: exact for float32 caches (tf32 would lose ~3 digits, and float32
    is the dtype we test tightly against the torch oracle); ignored for 16-bit inputs."""
    return "ieee" if is_float32 else "tf32"


def check_paged_inputs(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
) -> PagedKVLayout:
    """The shapes, dtypes and layouts both paged kernels assume (host-side metadata only: no sync);
    returns the caches' layout.

    query, out: [num_tokens, num_heads, head_size]; key_cache, value_cache: either layout of
    ``PagedKVLayout``; block_tables: [num_seqs, max_blocks] int32; seq_lens: [num_seqs] int32.
    """
    layout = PagedKVLayout.of(key_cache, value_cache)
    assert query.dim() == 3 and query.shape[2] == layout.head_size, (
        f"query {tuple(query.shape)} vs cache head_size {layout.head_size}"
    )
    assert query.shape[1] % layout.num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads"
    # Contiguous runs (of a key row, of a value row or column, of a query row) become 16-byte loads.
    assert layout.key_strides[4] == 1 and 1 in layout.value_strides[2:] and query.stride(2) == 1
    assert out.shape == query.shape and out.dtype == query.dtype and out.stride(2) == 1
    assert block_tables.dtype == torch.int32 and block_tables.shape[0] == seq_lens.shape[0]
    assert seq_lens.dtype == torch.int32 and seq_lens.dim() == 1
    return layout
