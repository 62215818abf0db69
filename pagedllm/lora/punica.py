"""The batched LoRA product of a step, Punica's contract (Chen et al., 2023, "Punica: Multi-Tenant
LoRA Serving"; vLLM's ``punica_wrapper``): every token t of the batch runs with the adapter in
slot ``s(t)`` (or none) and adds

    y[t] += (x[t] @ A[s(t)]^T) @ B[s(t)]^T          A[s]: [R, in], B[s]: [out, R], scale in B

to its projection's output, all adapters of the batch in one pass per projection.

The torch path here stacks the slots: ``A_all [S * R, in]`` holds every slot's A (slot s in rows
``s * R .. (s + 1) * R``, a rank-r adapter zero-padded to R), ``B_all [out, S * R]`` every B. Then

    shrink:  h = x @ A_all^T                 [T, S * R]   every slot's rank-R projection
    select:  h *= mask                       mask[t, s * R + k] = 1 if s(t) == s else 0
    expand:  y += h @ B_all^T                [T, out]

Two matmuls and a multiply per projection whatever the mix of adapters: the shapes depend on
the number of tokens only, so a decode step is captured in a CUDA graph as it is (the mask is
a buffer at a fixed address, refilled each step), and a token's result does not depend on the
other tokens of its batch (the masked columns add exact zeros). It costs ``S * R * (in + out)``
multiply-adds per token, against ``in * out`` for the projection: 3% for a 4096-wide layer with
8 slots of rank 16.

A fused projection (q/k/v, gate/up) has one block of ``S * R`` columns per slice: slice i's A in
rows ``i * S * R ..``, its B only in slice i's output rows, so one shrink and one expand serve
all slices (the mask repeats per slice).

On CUDA the same contract runs as Punica's kernels: each token reads only its own adapter's rows,
so the work does not grow with ``max_loras``. ``LoRABatch`` picks kernels or the torch product at
construction (the torch product is the reference the kernels are tested against), and, with
kernels, one per step by the step's shape (``set_token_slots``):

    step with a prefill chunk
        -> SGMV (``kernels/triton/lora_sgmv.py``): tokens grouped by slot once per step, a tile of
           16 or 64 tokens of one adapter per program, its weights read once per tile;
    decode-only step (one token per request, or a CUDA-graph batch) of 16 tokens or more
        -> SGMV, tiles of 16, over a grid that depends on the token count only: the segments
           live in a buffer at fixed addresses, refilled each step, so a graph replays them;
    decode-only step of fewer tokens
        -> BGMV (``kernels/triton/lora.py``): a program per token; the per-token slots live in a
           buffer at a fixed address, as the masks do here.

A layer calls ``shrink`` before its base projection and ``expand`` after it: the shrink reads only
x, so inside a CUDA graph capture it goes on a side stream and becomes a branch of the graph
beside the base GEMM, and the step's chain of kernels holds one LoRA kernel per projection.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from pagedllm.kernels.triton.lora_sgmv import SegmentPlan

# The slot of a token that runs without an adapter (vLLM's punica convention).
NO_SLOT = -1
# Tokens from which a decode step runs SGMV rather than BGMV: below, a step's tokens are too few
# to share an adapter's weights, and BGMV's per-token programs spread the work wider.
SGMV_DECODE_MIN_TOKENS = 16


class Shrunk(NamedTuple):
    """A projection's shrink, for its expand: h (the masked product's ``[T, C]``, or the kernels'
    split-K partials), whether the kernels run SGMV (else BGMV), and whether the shrink ran on
    the side stream (which the expand then joins)."""

    h: torch.Tensor
    sgmv: bool = False
    forked: bool = False


def token_lora_ids(row_lora_ids: np.ndarray, query_start_loc: np.ndarray, pad_to: int) -> np.ndarray:
    """[num_tokens (or pad_to)] int64: each token's adapter id (0: none), from its request's.

    row_lora_ids: [num_reqs] the step's requests' adapter ids in batch order; query_start_loc:
    their CSR offsets ([pad_to + 1] under a CUDA graph, where every request is one decode and the
    padding rows run without adapter)."""
    if pad_to:
        out = np.zeros(pad_to, dtype=np.int64)
        out[: len(row_lora_ids)] = row_lora_ids
        return out
    return np.repeat(row_lora_ids, np.diff(query_start_loc[: len(row_lora_ids) + 1]))


class LoRABatch:
    """The step's token -> slot mapping, and the product that reads it (``apply``), chosen once:
    kernels on CUDA (SGMV or BGMV, chosen per step), the masked product elsewhere (one mask buffer
    per number of slices, 1, 2 or 3). Buffers stay at fixed addresses (a captured graph reads
    them): the token slots, the segments, the masks.

    Args:
        num_slots: S, adapters per step (max_loras).
        max_rank: R, the rank every slot is sized for (max_lora_rank).
        max_num_tokens: most tokens in a step (or a captured graph's batch).
        slice_counts: the slice counts of the wrapped projections.
        use_kernels: the Triton kernels (default: on CUDA); tests run them on the CPU, interpreted.
    """

    def __init__(
        self,
        num_slots: int,
        max_rank: int,
        max_num_tokens: int,
        slice_counts: set[int],
        dtype: torch.dtype,
        device: torch.device,
        use_kernels: bool | None = None,
    ) -> None:
        self.num_slots, self.max_rank, self.device = num_slots, max_rank, device
        if use_kernels is None:
            use_kernels = device.type == "cuda"
        self._masks: dict[int, torch.Tensor] = {}
        self._token_slots = torch.full((max_num_tokens,), NO_SLOT, dtype=torch.int64, device=device)
        self.use_kernels = use_kernels
        if use_kernels:
            # Imported here: the triton package is needed on CUDA only.
            from pagedllm.kernels.triton import lora, lora_sgmv

            self._bgmv, self._sgmv, self._warm_up_sgmv = lora, lora_sgmv, lora_sgmv.warm_up
            self._segment_buffer = lora_sgmv.SegmentBuffer(max_num_tokens, num_slots, device)
            self._decode_block_m = min(lora_sgmv.BLOCK_MS)
            # The step's segments (SGMV's), at the buffer's fixed addresses; until a step sets
            # its own, none (what a CUDA graph is captured over).
            self._segments: SegmentPlan = self._plan_decode(np.empty(0, dtype=np.int64))
            # Where the shrink runs while the base projection does, inside a CUDA graph (see
            # ``_shrink_stream_if_captured``).
            self._side_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
            self.shrink, self.expand = self._shrink_kernels, self._expand_kernels
            return
        width = num_slots * max_rank
        self._masks = {
            n: torch.zeros(max_num_tokens, n * width, dtype=dtype, device=device) for n in slice_counts
        }
        # [S * R]: the slot each shrink column belongs to.
        self._column_slots = torch.arange(num_slots, device=device).repeat_interleave(max_rank)
        self.shrink, self.expand = self._shrink_masked, self._expand_masked

    def set_token_slots(self, token_slots: np.ndarray, has_prefill: bool = False) -> None:
        """token_slots: [num_tokens] int64, each token's slot or NO_SLOT; has_prefill: a request
        of the step computes more than one token.

        With kernels, a step with a prefill runs SGMV over exactly its tiles, of the height its
        segments call for; a decode-only step (a CUDA graph's among them) runs SGMV over a grid
        that depends on its token count only (a graph captured at that count replays any step's
        segments), or, below ``SGMV_DECODE_MIN_TOKENS`` tokens, BGMV over the token slots."""
        if self.use_kernels and has_prefill:
            self._segments = self._segment_buffer.plan(token_slots)
            return
        if self.use_kernels:
            self._segments = self._plan_decode(token_slots)
        slots = torch.from_numpy(np.ascontiguousarray(token_slots, dtype=np.int64))
        if self.device.type != "cpu":
            # Pinned: one asynchronous copy straight into the buffer (a pageable copy would wait
            # for the device to drain; the caching host allocator keeps the staging tensor until
            # its copy has run).
            slots = slots.pin_memory()
        num_tokens = len(token_slots)
        token_slots_now = self._token_slots[:num_tokens]
        token_slots_now.copy_(slots, non_blocking=True)
        if self._masks:
            selected = token_slots_now[:, None] == self._column_slots[None, :]  # [T, S * R]
            for num_slices, mask in self._masks.items():
                mask[:num_tokens].copy_(selected.repeat(1, num_slices))

    def _plan_decode(self, token_slots: np.ndarray) -> SegmentPlan:
        return self._segment_buffer.plan(token_slots, self._decode_block_m, fixed_grid=True)

    def warm_up(self, projections: Iterable[tuple[torch.Tensor, torch.Tensor, tuple[int, int]]]) -> None:
        """With kernels: compile SGMV's variants for each distinct projection (``(lora_a, lora_b,
        slice_starts)`` of every wrapped projection) before the first step. The engine's own
        warm-up (the profile run) has no adapter, so SGMV launches nothing there, and each variant
        would otherwise compile inside the first step that needs it. BGMV's variants
        compile when the decode CUDA graphs are captured."""
        if not self.use_kernels:
            return
        seen = set()
        for lora_a, lora_b, starts in projections:
            key = (lora_a.shape, lora_a.stride(), lora_b.shape, lora_b.stride(), lora_a.dtype, starts)
            if key not in seen:
                seen.add(key)
                self._warm_up_sgmv(lora_a, lora_b, self.num_slots, self.max_rank, starts)

    def mask(self, num_slices: int, num_tokens: int) -> torch.Tensor:
        """[num_tokens, num_slices * S * R] in the run dtype (the masked product's)."""
        return self._masks[num_slices][:num_tokens]

    def apply(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        lora_a: torch.Tensor,
        lora_b: torch.Tensor,
        num_slices: int,
        slice_starts: tuple[int, int],
    ) -> None:
        """y [T, out] += each token's adapter's (x A^T) B^T: ``shrink`` then ``expand``. A layer
        calls the two itself, around its base projection, which the shrink may overlap."""
        self.expand(y, self.shrink(x, lora_a, num_slices), lora_b, slice_starts)

    # shrink(x, lora_a, num_slices) -> Shrunk; expand(y, shrunk, lora_b, slice_starts): bound at
    # construction to one of the pairs below.

    def _shrink_masked(self, x: torch.Tensor, lora_a: torch.Tensor, num_slices: int) -> Shrunk:
        """h = (x [T, in] @ lora_a [C, in]^T) * mask [T, C]."""
        return Shrunk(F.linear(x, lora_a) * self.mask(num_slices, x.shape[0]))

    def _expand_masked(
        self, y: torch.Tensor, shrunk: Shrunk, lora_b: torch.Tensor, slice_starts: tuple[int, int]
    ) -> None:
        """y [T, out] += h @ lora_b [out, C]^T, in place."""
        y += F.linear(shrunk.h, lora_b)

    def _shrink_kernels(self, x: torch.Tensor, lora_a: torch.Tensor, num_slices: int) -> Shrunk:
        # Chosen by the launch's token count where the grid is fixed: the same at capture and replay.
        sgmv = not self._segments.fixed_grid or x.shape[0] >= SGMV_DECODE_MIN_TOKENS
        # h is allocated on the layer's stream, which alone uses and frees it (after the expand).
        if sgmv:
            h = self._sgmv.sgmv_partials(x, lora_a, self._segments, self.num_slots)
        else:
            h = self._bgmv.bgmv_partials(x, lora_a, self.num_slots)
        with self._shrink_stream_if_captured() as forked:
            if sgmv:
                self._sgmv.sgmv_shrink(h, x, lora_a, self._segments, self.num_slots, self.max_rank)
            else:
                token_slots = self._token_slots[: x.shape[0]]
                self._bgmv.bgmv_shrink(h, x, lora_a, token_slots, self.num_slots, self.max_rank)
        return Shrunk(h, sgmv, forked)

    def _expand_kernels(
        self, y: torch.Tensor, shrunk: Shrunk, lora_b: torch.Tensor, slice_starts: tuple[int, int]
    ) -> None:
        if shrunk.forked:
            torch.cuda.current_stream(self.device).wait_stream(self._side_stream)
        h, rank = shrunk.h, self.max_rank
        if shrunk.sgmv:
            self._sgmv.sgmv_expand(y, h, lora_b, self._segments, self.num_slots, rank, slice_starts)
        else:
            token_slots = self._token_slots[: y.shape[0]]
            self._bgmv.bgmv_expand(y, h, lora_b, token_slots, self.num_slots, rank, slice_starts)

    @contextlib.contextmanager
    def _shrink_stream_if_captured(self) -> Iterator[bool]:
        """Inside a CUDA graph capture, the shrink goes on the side stream, forked from the
        layer's: in the graph it becomes a branch that runs beside the base projection (which
        reads the same x) instead of a node before it, and the expand joins the two. A decode
        step of a few tokens is a chain of small kernels, each costing a launch latency on the
        device (W3 with one adapter: 128 shrinks a token); the branch takes the shrinks off that
        chain. Outside a capture (prefill steps, eager mode) the fork would cost the host two
        events per projection and save nothing the host does not pay already: one stream.
        Yields whether it forked."""
        stream = self._side_stream
        if stream is None or not torch.cuda.is_current_stream_capturing():
            yield False
            return
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            yield True
