"""Decode steps replayed from captured CUDA graphs.

A decode step of a small model is dozens of short kernels per layer; launching them one by one
from Python costs more than running them. A CUDA graph launches the whole forward pass at once.
One graph is captured per batch size in ``capture_sizes``; a step of n decodes replays the
smallest captured size >= n, its extra rows padded (by the model runner, in the same host-to-device
copies as the real rows) so that they write nothing (slot -1) and attend to one token.

Graphs read the model inputs at the fixed addresses of ``InputBuffers`` and attention bounded by
``max_model_len`` (the number of context partitions is part of the captured launch). Each is
captured under the forward context of ``metadata(batch_size)``, whose tensors are views of those
buffers: what a replay reads is whatever the runner copied into them for the step, and the
KV caches bound to the layers when it was captured.
"""

from __future__ import annotations

import bisect
import logging
import time

import numpy as np
import torch
from torch import nn

from pagedllm.attention.forward_context import set_forward_context
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.worker.input_buffers import InputBuffers

logger = logging.getLogger(__name__)


# With speculative decoding a step's verifications are decodes, one per token (batch expansion,
# worker/step_inputs.py): up to max_num_seqs * (k + 1) of them. Graphs are captured for up to this
# many (vLLM's default largest capture size) or max_num_seqs if more: a step past it is
# compute-bound, where launching kernels one by one costs little, and runs eagerly.
MAX_EXPANDED_CAPTURE_SIZE = 512


def default_capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to max_num_seqs: padding wastes at most 15 rows."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_num_seqs] + list(range(16, max_num_seqs + 1, 16))
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


def graph_capture_sizes(max_num_seqs: int, max_num_step_seqs: int) -> list[int]:
    """Capture sizes for decode steps of up to ``max_num_step_seqs`` sequences (more than
    ``max_num_seqs`` when verifications are expanded): up to ``max_num_seqs``, and past it up to
    ``MAX_EXPANDED_CAPTURE_SIZE``."""
    return default_capture_sizes(max(max_num_seqs, min(max_num_step_seqs, MAX_EXPANDED_CAPTURE_SIZE)))


class CudaGraphRunner:
    def __init__(
        self,
        model: nn.Module,
        buffers: InputBuffers,
        capture_sizes: list[int],
        max_model_len: int,
        max_decode_query_len: int = 1,
    ) -> None:
        """max_decode_query_len: with expanded verifications, num_speculative_tokens + 1 (the
        steps' query groups, AttentionMetadata.decode_query_lens); 1 without."""
        self.model = model
        self.max_decode_query_len = max_decode_query_len
        self.buffers = buffers
        self.capture_sizes = sorted(capture_sizes)
        self.max_model_len = max_model_len
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}

    @property
    def max_batch_size(self) -> int:
        return self.capture_sizes[-1]

    def padded_size(self, num_seqs: int) -> int:
        return self.capture_sizes[bisect.bisect_left(self.capture_sizes, num_seqs)]

    def metadata(self, batch_size: int) -> AttentionMetadata:
        """What every captured step sees: batch_size decodes, contexts up to max_model_len."""
        seq_lens = self.buffers.device_view("seq_lens", batch_size)
        query_start_loc = self.buffers.device_view("query_start_loc", batch_size + 1)
        return AttentionMetadata(
            num_decodes=batch_size,
            num_prefills=0,
            slot_mapping=self.buffers.device_view("slot_mapping", batch_size),
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables=self.buffers.device_view("block_tables", batch_size),
            max_query_len=1,
            max_seq_len=self.max_model_len,
            query_start_loc_cpu=torch.arange(batch_size + 1, dtype=torch.int32),
            seq_lens_cpu=torch.ones(batch_size, dtype=torch.int32),
            state_slots=self.buffers.device_view("state_slots", batch_size),
            decode_query_lens=self.buffers.device_view("decode_query_lens", batch_size)
            if self.max_decode_query_len > 1
            else None,
            max_decode_query_len=self.max_decode_query_len,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        # Dummy decodes while capturing: slot -1 writes nothing, length 1 reads block 0 only.
        max_size = self.max_batch_size
        # State slot -1 is the state cache's scratch row (hybrid models).
        dummies = (
            ("input_ids", 0),
            ("positions", 0),
            ("slot_mapping", -1),
            ("seq_lens", 1),
            ("decode_query_lens", 1),
        )
        for name, value in (*dummies, ("state_slots", -1)):
            self.buffers.put(name, np.full(max_size, value))
        self.buffers.put("query_start_loc", np.arange(max_size + 1))
        self.buffers.put("block_tables", np.zeros((max_size, 1), dtype=np.int32))
        # Largest first: smaller graphs then reuse its memory from the shared pool.
        for batch_size in reversed(self.capture_sizes):
            input_ids = self.buffers.device_view("input_ids", batch_size)
            positions = self.buffers.device_view("positions", batch_size)
            metadata = self.metadata(batch_size)
            # Warm-up runs compile Triton kernels and settle allocations outside the capture.
            # Each pass its own context: what the capture's layers derive from the metadata must
            # be computed inside it (forward_context.py).
            for _ in range(2):
                with set_forward_context(metadata):
                    self.model(input_ids, positions)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with set_forward_context(metadata), torch.cuda.graph(graph, pool=pool):
                self._outputs[batch_size] = self.model(input_ids, positions)
            self._graphs[batch_size] = graph
        torch.cuda.synchronize()
        logger.info(
            "captured %d CUDA graphs (decode batch sizes up to %d) in %.1f s",
            len(self._graphs),
            self.max_batch_size,
            time.perf_counter() - start,
        )

    def output(self, batch_size: int) -> torch.Tensor:
        """The hidden states the graph of ``batch_size`` rows writes: [batch_size, hidden]."""
        return self._outputs[batch_size]

    def replay(self, num_seqs: int) -> torch.Tensor:
        """Run the captured step for the num_seqs decodes already in the buffers, padded by the
        caller to ``padded_size(num_seqs)`` rows. Returns their hidden states: [num_seqs, hidden]."""
        batch_size = self.padded_size(num_seqs)
        self._graphs[batch_size].replay()
        return self._outputs[batch_size][:num_seqs]
