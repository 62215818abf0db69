"""A drafter's one-token proposal steps, eagerly or replayed from CUDA graphs.

A draft model proposes k tokens by k one-token steps, an EAGLE head by k - 1 after its pass over
the step's tokens (worker/draft_model.py, worker/eagle.py): each step a forward pass of a few
kernels per layer, an LM head and an argmax over a handful of rows, where launching the kernels
one by one costs more than running them. Every input of the loop is known before its first step
runs (each request's positions P, P + 1, ..., their slots through the scratch block table, their
context lengths) except the tokens, which each step's argmax hands to the next on the device. So
the whole loop is captured as ONE graph per batch size, reading static buffers::

    tokens        [N]         the first step's input tokens (then each step's argmax, in the graph)
    hidden        [N, H]      an EAGLE head's first hidden input (a draft model has none: H = 0)
    positions     [S, N]      int64, step s's positions
    slot_mapping  [S, N]      int64, -1 on padding rows (nothing written)
    seq_lens      [S, N]      int32, 1 on padding rows
    block_tables  [N, W]      int32, the requests' scratch tables
    drafts        [N, S]      int64, the output: step s's argmax in column s

A loop over B requests copies its inputs into the first B rows, pads the rest and replays the
graph of the smallest captured size >= B. As in the decode graphs (worker/cuda_graph.py), attention
is bounded by max_model_len: the launch grids are fixed at capture, the lengths read on the device.
Without a capture (the CPU, or more requests than the largest graph), the same loop runs eagerly
on per-step metadata built from the host arrays.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.attention import set_forward_context
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.worker.input_buffers import to_device
from pagedllm.worker.step_inputs import compute_slot_mapping

logger = logging.getLogger(__name__)

MaybeTensor = torch.Tensor | None
# step(tokens [B], positions [B], hidden [B, H] or None) -> (argmax tokens [B], next hidden or None),
# run under the step's forward context.
ProposalStep = Callable[[torch.Tensor, torch.Tensor, MaybeTensor], tuple[torch.Tensor, MaybeTensor]]


@dataclass
class ProposalInputs:
    """A proposal loop's inputs on the host: ``S`` one-token steps of ``B`` requests."""

    positions: np.ndarray  # [S, B] int64
    slot_mapping: np.ndarray  # [S, B] int64
    seq_lens: np.ndarray  # [S, B] int32
    block_tables: np.ndarray  # [B, W] int32

    @property
    def num_steps(self) -> int:
        return self.positions.shape[0]


def proposal_inputs(
    block_tables: np.ndarray, newest: np.ndarray, num_steps: int, block_size: int, max_model_len: int
) -> ProposalInputs:
    """block_tables: [B, W] the requests' scratch tables; newest: [B] the position P of each one's
    newest token. Step s of request b is at P + s (clamped below max_model_len: the scheduler
    cuts drafts past it anyway), writes its slot through the table and reads P + s + 1 tokens."""
    positions = np.minimum(newest + np.arange(num_steps)[:, None], max_model_len - 1)
    slot_mapping = compute_slot_mapping(
        np.tile(block_tables, (num_steps, 1)), positions.reshape(-1), block_size
    ).reshape(positions.shape)
    return ProposalInputs(positions, slot_mapping, (positions + 1).astype(np.int32), block_tables)


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


def eager_steps(inputs: ProposalInputs, device: torch.device) -> list[tuple[torch.Tensor, AttentionMetadata]]:
    """Each step's positions (device) and metadata: one query token per request, exact lengths."""
    num_reqs = inputs.positions.shape[1]
    query_start_loc = np.arange(num_reqs + 1, dtype=np.int32)
    device_query_start_loc = to_device(query_start_loc, device)
    block_tables = to_device(inputs.block_tables, device)
    steps = []
    for positions, slot_mapping, seq_lens in zip(inputs.positions, inputs.slot_mapping, inputs.seq_lens):
        metadata = AttentionMetadata(
            num_decodes=num_reqs,
            num_prefills=0,
            slot_mapping=to_device(slot_mapping, device),
            query_start_loc=device_query_start_loc,
            seq_lens=to_device(seq_lens, device),
            block_tables=block_tables,
            max_query_len=1,
            max_seq_len=int(seq_lens.max()),
            query_start_loc_cpu=torch.from_numpy(query_start_loc),
            seq_lens_cpu=torch.from_numpy(seq_lens),
            min_decode_seq_len=int(seq_lens.min()),
        )
        steps.append((to_device(positions, device), metadata))
    return steps


class ProposalGraphs:
    """The static buffers of a proposal loop, and its graphs once ``capture`` ran (CUDA only).

    Args:
        step: the drafter's one-token step.
        num_steps: S, steps per loop.
        capture_sizes: the batch sizes (requests) to capture.
        hidden_size: H of the hidden input the step carries (0: none) and its dtype.
        table_width: W, columns of the scratch block tables.
        max_model_len: attention's bound in the captured launches.
    """

    def __init__(
        self,
        step: ProposalStep,
        num_steps: int,
        capture_sizes: list[int],
        hidden: tuple[int, torch.dtype],
        table_width: int,
        max_model_len: int,
        device: torch.device,
    ) -> None:
        self.step = step
        self.capture_sizes = sorted(capture_sizes)
        self.max_model_len = max_model_len
        self.device = device
        n, hidden_size = self.capture_sizes[-1], hidden[0]

        def zeros(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.tokens = zeros(n)
        self.hidden = zeros(n, hidden_size, dtype=hidden[1]) if hidden_size else None
        self.positions = zeros(num_steps, n)
        self.slot_mapping = zeros(num_steps, n)
        self.seq_lens = zeros(num_steps, n, dtype=torch.int32)
        self.block_tables = zeros(n, table_width, dtype=torch.int32)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.drafts = zeros(n, num_steps)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}

    @property
    def max_batch_size(self) -> int:
        return self.capture_sizes[-1]

    def _steps(self, batch_size: int) -> list[tuple[torch.Tensor, AttentionMetadata]]:
        """What every replay reads: views of the buffers' first ``batch_size`` rows, lengths up to
        max_model_len (``seq_lens_cpu`` that bound: a replay serves every length below it)."""
        bound = torch.full((batch_size,), self.max_model_len, dtype=torch.int32)
        return [
            (
                self.positions[s, :batch_size],
                AttentionMetadata(
                    num_decodes=batch_size,
                    num_prefills=0,
                    slot_mapping=self.slot_mapping[s, :batch_size],
                    query_start_loc=self.query_start_loc[: batch_size + 1],
                    seq_lens=self.seq_lens[s, :batch_size],
                    block_tables=self.block_tables[:batch_size],
                    max_query_len=1,
                    max_seq_len=self.max_model_len,
                    query_start_loc_cpu=torch.arange(batch_size + 1, dtype=torch.int32),
                    seq_lens_cpu=bound,
                ),
            )
            for s in range(self.positions.shape[0])
        ]

    def _run(self, batch_size: int) -> None:
        hidden = None if self.hidden is None else self.hidden[:batch_size]
        drafts = self.drafts[:batch_size]
        run_steps(self.step, self.tokens[:batch_size], hidden, self._steps(batch_size), drafts)

    @torch.inference_mode()
    def capture(self) -> None:
        """One graph per capture size, largest first (the smaller ones reuse its pool memory), over
        dummy rows: slot -1 writes nothing, length 1 reads block 0 only."""
        start = time.perf_counter()
        self.slot_mapping.fill_(-1)
        self.seq_lens.fill_(1)
        pool = torch.cuda.graph_pool_handle()
        for batch_size in reversed(self.capture_sizes):
            for _ in range(2):  # compile the Triton kernels and settle allocations outside the capture
                self._run(batch_size)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._run(batch_size)
            self._graphs[batch_size] = graph
        torch.cuda.synchronize()
        logger.info(
            "captured %d CUDA graphs of %d proposal steps (up to %d requests) in %.1f s",
            len(self._graphs),
            self.positions.shape[0],
            self.max_batch_size,
            time.perf_counter() - start,
        )

    def run(self, tokens: torch.Tensor, hidden: torch.Tensor | None, inputs: ProposalInputs) -> torch.Tensor:
        """tokens: [B] and hidden: [B, H] (device), B <= ``max_batch_size``. Copies them and the
        inputs into the buffers, padded to the captured size, and replays (or, before a capture,
        runs the loop on the buffers). Returns the drafts: [B, S], a view of the output buffer."""
        num_reqs = tokens.shape[0]
        batch_size = self.capture_sizes[bisect.bisect_left(self.capture_sizes, num_reqs)]
        self.tokens[:num_reqs].copy_(tokens)
        if self.hidden is not None:
            assert hidden is not None
            self.hidden[:num_reqs].copy_(hidden)
        padded = (
            (self.positions, inputs.positions, 0),
            (self.slot_mapping, inputs.slot_mapping, -1),
            (self.seq_lens, inputs.seq_lens, 1),
        )
        for buffer, array, pad_value in padded:
            buffer[:, :num_reqs].copy_(to_device(array, self.device))
            buffer[:, num_reqs:batch_size].fill_(pad_value)
        width = inputs.block_tables.shape[1]
        self.block_tables[:num_reqs, :width].copy_(to_device(inputs.block_tables, self.device))
        self.block_tables[num_reqs:batch_size].zero_()
        graph = self._graphs.get(batch_size)
        if graph is not None:
            graph.replay()
        else:
            self._run(batch_size)
        return self.drafts[:num_reqs]
