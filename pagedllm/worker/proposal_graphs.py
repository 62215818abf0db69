"""A drafter's one-token proposal steps, eagerly or replayed from CUDA graphs.

A draft model proposes k tokens by k one-token steps, an EAGLE head by k - 1 after its pass over
the step's tokens (worker/draft_model.py, worker/eagle.py): each step a forward pass of a few
kernels per layer, an LM head and an argmax over a handful of rows, where launching the kernels
one by one costs more than running them. Every input of the loop follows from each request's
block table and newest position P (which may include a verification's accepted drafts the host
has not seen yet): the drafter's ``prepare`` builds its scratch tables (copying the block holding
P into them) and the positions P, P + 1, ..., their slots and context lengths, on the device; the
tokens each step's argmax hands to the next on the device. So the whole loop, its preparation
included, is captured as ONE graph per batch size, reading static buffers::

    tokens        [N]         the first step's input tokens (then each step's argmax, in the graph)
    hidden        [N, H]      an EAGLE head's first hidden input (a draft model has none: H = 0)
    newest        [N]         int64, each request's P (0 on padding rows)
    block_tables  [N, W]      int32, the requests' own tables (0 on padding rows)
    valid         [N]         bool, False on padding rows: slot -1 (nothing written), length 1
    drafts        [N, S]      int64, the output: step s's argmax in column s

A loop over B requests copies its inputs into the first B rows, pads the rest and replays the
graph of the smallest captured size >= B: a few copies of host work, where preparing the inputs
eagerly took tens of launches. As in the decode graphs (worker/cuda_graph.py), attention is
bounded by max_model_len: the launch grids are fixed at capture, the lengths read on the device.
Without a capture (the CPU, or more requests than the largest graph), the same preparation and
loop run eagerly, on per-step metadata whose lengths are read to the host.

``StepPassGraphs`` (below) captures the drafter's other pass, over a step's scheduled tokens.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from pagedllm.attention import set_forward_context
from pagedllm.attention.metadata import AttentionMetadata

logger = logging.getLogger(__name__)
T = TypeVar("T")

MaybeTensor = torch.Tensor | None
# step(tokens [B], positions [B], hidden [B, H] or None) -> (argmax tokens [B], next hidden or None),
# run under the step's forward context.
ProposalStep = Callable[[torch.Tensor, torch.Tensor, MaybeTensor], tuple[torch.Tensor, MaybeTensor]]


@dataclass
class ProposalInputs:
    """A proposal loop's inputs, ``S`` one-token steps of ``B`` requests, on the drafter's device:
    computed there from each request's newest position, which may still be on its way from the
    verification that produced it (nothing here waits for the host)."""

    positions: torch.Tensor  # [S, B] int64
    slot_mapping: torch.Tensor  # [S, B] int64
    seq_lens: torch.Tensor  # [S, B] int32
    block_tables: torch.Tensor  # [B, W] int32

    @property
    def num_steps(self) -> int:
        return self.positions.shape[0]


def proposal_inputs(
    block_tables: torch.Tensor,
    newest: torch.Tensor,
    num_steps: int,
    block_size: int,
    max_model_len: int,
    valid: torch.Tensor | None = None,
) -> ProposalInputs:
    """block_tables: [B, W] int32 the requests' scratch tables; newest: [B] int64 the position P of
    each one's newest token (same device). Step s of request b is at P + s (clamped below
    max_model_len: the scheduler cuts drafts past it anyway), writes its slot through the table
    and reads P + s + 1 tokens. ``valid`` ([B] bool): rows past the requests (a graph's padding)
    write nothing (slot -1) and read one token."""
    steps = torch.arange(num_steps, device=newest.device)[:, None]
    positions = (newest[None, :] + steps).clamp(max=max_model_len - 1)
    blocks = block_tables.long().gather(1, (positions // block_size).t()).t().contiguous()
    slot_mapping = blocks * block_size + positions % block_size
    seq_lens = (positions + 1).to(torch.int32)
    if valid is not None:
        slot_mapping = slot_mapping.masked_fill(~valid, -1)
        seq_lens = seq_lens.masked_fill(~valid, 1)
    return ProposalInputs(positions, slot_mapping, seq_lens, block_tables)


def capture_per_size(
    run: Callable[[int], T], capture_sizes: list[int]
) -> tuple[dict[int, torch.cuda.CUDAGraph], dict[int, T]]:
    """One graph of ``run(batch_size)`` per size, largest first (the smaller ones reuse its pool
    memory), each after two runs outside the capture (Triton's compiles, settled allocations).
    Returns the graphs and what each captured run returned (its outputs' static tensors)."""
    pool = torch.cuda.graph_pool_handle()
    graphs: dict[int, torch.cuda.CUDAGraph] = {}
    outputs: dict[int, T] = {}
    for batch_size in reversed(capture_sizes):
        for _ in range(2):
            run(batch_size)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            outputs[batch_size] = run(batch_size)
        graphs[batch_size] = graph
    torch.cuda.synchronize()
    return graphs, outputs


def run_steps(
    step: ProposalStep,
    tokens: torch.Tensor,
    hidden: torch.Tensor | None,
    steps: list[tuple[torch.Tensor, AttentionMetadata]],
    drafts: torch.Tensor,
) -> None:
    """The loop: step s under its (positions, metadata) writes its argmax into ``drafts[:, s]``."""
    for s, (positions, metadata) in enumerate(steps):
        with set_forward_context(metadata):
            tokens, hidden = step(tokens, positions, hidden)
        drafts[:, s] = tokens


def eager_steps(inputs: ProposalInputs) -> list[tuple[torch.Tensor, AttentionMetadata]]:
    """Each step's positions and metadata: one query token per request, exact lengths (read on the
    host: free on the CPU, a wait on a GPU running without the loop's graphs)."""
    num_reqs = inputs.positions.shape[1]
    device = inputs.positions.device
    query_start_loc = torch.arange(num_reqs + 1, dtype=torch.int32)
    device_query_start_loc = query_start_loc.to(device)
    host_seq_lens = inputs.seq_lens.cpu()
    steps = []
    for s in range(inputs.num_steps):
        seq_lens = host_seq_lens[s]
        metadata = AttentionMetadata(
            num_decodes=num_reqs,
            num_prefills=0,
            slot_mapping=inputs.slot_mapping[s],
            query_start_loc=device_query_start_loc,
            seq_lens=inputs.seq_lens[s],
            block_tables=inputs.block_tables,
            max_query_len=1,
            max_seq_len=int(seq_lens.max()),
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens,
            min_decode_seq_len=int(seq_lens.min()),
        )
        steps.append((inputs.positions[s], metadata))
    return steps


# prepare(block_tables [B, W] int32, newest [B] int64, valid [B] bool or None) -> the loop's inputs:
# the drafter's scratch tables (and the copies into them) and the steps' positions, slots, lengths.
ProposalPrepare = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], ProposalInputs]


class ProposalGraphs:
    """The static buffers of a proposal loop, and its graphs once ``capture`` ran (CUDA only).

    The graph holds the loop's preparation too (``prepare``: the scratch tables, the copies of
    the blocks holding P into them, the steps' positions, slots and lengths), so that a replay
    costs the host a few copies into the buffers, not the tens of launches of the preparation.

    Args:
        step: the drafter's one-token step.
        prepare: the loop's inputs from the requests' block tables and newest positions.
        num_steps: S, steps per loop.
        capture_sizes: the batch sizes (requests) to capture.
        hidden: H of the hidden input the step carries (0: none) and its dtype.
        table_width: W, columns of the requests' block tables.
        max_model_len: attention's bound in the captured launches.
    """

    def __init__(
        self,
        step: ProposalStep,
        prepare: ProposalPrepare,
        num_steps: int,
        capture_sizes: list[int],
        hidden: tuple[int, torch.dtype],
        table_width: int,
        max_model_len: int,
        device: torch.device,
    ) -> None:
        self.step = step
        self.prepare = prepare
        self.capture_sizes = sorted(capture_sizes)
        self.max_model_len = max_model_len
        self.device = device
        n, hidden_size = self.capture_sizes[-1], hidden[0]

        def zeros(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.tokens = zeros(n)
        self.hidden = zeros(n, hidden_size, dtype=hidden[1]) if hidden_size else None
        self.newest = zeros(n)
        self.block_tables = zeros(n, table_width, dtype=torch.int32)
        self.valid = zeros(n, dtype=torch.bool)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.drafts = zeros(n, num_steps)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}

    @property
    def max_batch_size(self) -> int:
        return self.capture_sizes[-1]

    def _steps(self, inputs: ProposalInputs) -> list[tuple[torch.Tensor, AttentionMetadata]]:
        """What every replay reads: the prepared inputs of the buffers' first rows, lengths up to
        max_model_len (``seq_lens_cpu`` that bound: a replay serves every length below it)."""
        batch_size = inputs.positions.shape[1]
        bound = torch.full((batch_size,), self.max_model_len, dtype=torch.int32)
        return [
            (
                inputs.positions[s],
                AttentionMetadata(
                    num_decodes=batch_size,
                    num_prefills=0,
                    slot_mapping=inputs.slot_mapping[s],
                    query_start_loc=self.query_start_loc[: batch_size + 1],
                    seq_lens=inputs.seq_lens[s],
                    block_tables=inputs.block_tables,
                    max_query_len=1,
                    max_seq_len=self.max_model_len,
                    query_start_loc_cpu=torch.arange(batch_size + 1, dtype=torch.int32),
                    seq_lens_cpu=bound,
                ),
            )
            for s in range(inputs.num_steps)
        ]

    def _run(self, batch_size: int) -> None:
        rows = slice(0, batch_size)
        inputs = self.prepare(self.block_tables[rows], self.newest[rows], self.valid[rows])
        hidden = None if self.hidden is None else self.hidden[rows]
        run_steps(self.step, self.tokens[rows], hidden, self._steps(inputs), self.drafts[rows])

    @torch.inference_mode()
    def capture(self) -> None:
        """One graph per capture size, largest first (the smaller ones reuse its pool memory), over
        padding rows only: slot -1 writes nothing, length 1 reads block 0 only."""
        start = time.perf_counter()
        self.valid.fill_(False)
        self._graphs = capture_per_size(self._run, self.capture_sizes)[0]
        logger.info(
            "captured %d CUDA graphs of %d proposal steps (up to %d requests) in %.1f s",
            len(self._graphs),
            self.drafts.shape[1],
            self.max_batch_size,
            time.perf_counter() - start,
        )

    def run(
        self,
        tokens: torch.Tensor,
        hidden: torch.Tensor | None,
        block_tables: torch.Tensor,
        newest: torch.Tensor,
    ) -> torch.Tensor:
        """tokens: [B] and hidden: [B, H], the requests' block tables [B, W] int32 and newest
        positions [B] int64 (device), B <= ``max_batch_size``. Copies them into the buffers,
        padded to the captured size, and replays (or, before a capture, runs the loop on the
        buffers). Returns the drafts: [B, S], a view of the output buffer."""
        num_reqs = tokens.shape[0]
        batch_size = self.capture_sizes[bisect.bisect_left(self.capture_sizes, num_reqs)]
        real, padding = slice(0, num_reqs), slice(num_reqs, batch_size)
        self.tokens[real].copy_(tokens)
        if self.hidden is not None:
            assert hidden is not None
            self.hidden[real].copy_(hidden)
        self.newest[real].copy_(newest)
        self.newest[padding].zero_()
        self.block_tables[real, : block_tables.shape[1]].copy_(block_tables)
        self.block_tables[padding].zero_()
        self.valid[real].fill_(True)
        self.valid[padding].fill_(False)
        graph = self._graphs.get(batch_size)
        if graph is not None:
            graph.replay()
        else:
            self._run(batch_size)
        return self.drafts[real]


# pass(batch_size) -> outputs: the drafter's pass over a step's tokens, on the target's decode
# graph buffers' first batch_size rows, under the forward context set by the caller.
StepPass = Callable[[int], tuple[torch.Tensor, ...]]


class StepPassGraphs:
    """The drafter's pass over a step's scheduled tokens, replayed from a CUDA graph when the
    target's step replayed one (a step of decodes and verifications): one graph per capture size
    of the target's (``CudaGraphRunner``), reading the same static input buffers and attention
    metadata the target's graph read, and the target's hidden states where it left them.

    The pass is a layer or a small model over a few rows: launched kernel by kernel, its host
    time (tens of launches, each through the layers' Python) exceeded its device time, and it
    sits on the step's critical path. A step with prefill chunks runs the pass eagerly.

    Args:
        step_pass: the pass, over the first ``batch_size`` rows of its static inputs.
        metadata: the target graphs' attention metadata per batch size (views of their buffers).
        capture_sizes: the target graphs' sizes.
    """

    def __init__(
        self,
        step_pass: StepPass,
        metadata: Callable[[int], AttentionMetadata],
        capture_sizes: list[int],
    ) -> None:
        self.step_pass = step_pass
        self.metadata = metadata
        self.capture_sizes = sorted(capture_sizes)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, tuple[torch.Tensor, ...]] = {}

    def _run(self, batch_size: int) -> tuple[torch.Tensor, ...]:
        # A context per pass: what layers derive from the metadata is computed in each one.
        with set_forward_context(self.metadata(batch_size)):
            return self.step_pass(batch_size)

    @torch.inference_mode()
    def capture(self) -> None:
        """Over the target graphs' dummy rows (slot -1 writes nothing), largest size first."""
        start = time.perf_counter()
        self._graphs, self._outputs = capture_per_size(self._run, self.capture_sizes)
        logger.info(
            "captured %d CUDA graphs of the drafter's pass over a step's tokens in %.1f s",
            len(self._graphs),
            time.perf_counter() - start,
        )

    def replay(self, num_tokens: int) -> tuple[torch.Tensor, ...]:
        """The pass over the first ``num_tokens`` rows (its inputs already in the buffers): its
        outputs' first ``num_tokens`` rows."""
        batch_size = self.capture_sizes[bisect.bisect_left(self.capture_sizes, num_tokens)]
        self._graphs[batch_size].replay()
        return tuple(t[:num_tokens] for t in self._outputs[batch_size])
