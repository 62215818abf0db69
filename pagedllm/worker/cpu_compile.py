"""One stream's decode step on the CPU, compiled by torch.compile (inductor's C++ backend).

Eagerly, a one-token step of a small model is mostly dispatch: each decoder layer runs ~100 small
torch ops (norms, rotary, views, casts, residual adds) around its four matmuls and its attention,
at microseconds each. Compiled, those ops become a few fused C++ loops; the matmuls stay the same
kernels (int4 or oneDNN) and attention stays the backend's, one opaque op per layer
(``pagedllm::attention``, attention/layer.py) that reads the step's metadata from the forward
context when it runs, outside the graph. So one graph serves every context length: its inputs are
the token, its position and the caches bound to the layers, all of fixed shape.

Only steps of exactly one decode take it (one stream; the batched steps and prefills run eagerly),
so there is one graph to compile. Inductor caches the compiled graph on disk (its FX graph cache,
under ``TORCHINDUCTOR_CACHE_DIR``): the first engine on a machine pays the compilation, later
ones load it (benchmarks/RESULTS.md has both costs).
"""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from pagedllm.attention.forward_context import set_forward_context
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.layers.linear import LinearBase
from pagedllm.layers.onednn_linear import OneDNNLinearMethod

logger = logging.getLogger(__name__)


def _guard_filter(guard_entries: list) -> list[bool]:
    """Which of dynamo's guards to keep: none on module attributes but the tensors that are not
    parameters, the KV caches bound to the layers above all. The weights never change after
    loading, and guarding on every module attribute cost ~1.3 ms a step (the whole step is
    ~12 ms); the caches' shapes tell one model's graph from another's, as when they were inputs
    (every model's forward is one code object, whose graphs dynamo keeps together)."""
    return [
        not entry.orig_guard.source.is_unspecialized_nn_module()
        or (entry.guard_type == "TENSOR_MATCH" and not isinstance(entry.value, nn.Parameter))
        for entry in guard_entries
    ]


class CompiledDecode:
    """``model(input_ids, positions)`` for one decode token, compiled; called, as the model, inside
    the step's ``set_forward_context``."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._forward = torch.compile(
            model.forward, fullgraph=True, dynamic=False, options={"guard_filter_fn": _guard_filter}
        )

    @staticmethod
    def supports(model: nn.Module) -> bool:
        """Inductor cannot lower oneDNN's linear on a prepacked weight (an opaque tensor), so
        models with dense linear layers stay eager; the GGUF Q4 path (int4 layers) compiles. The
        LM head, prepacked too, is outside the compiled forward."""
        return not any(
            isinstance(m, LinearBase) and isinstance(m.quant_method, OneDNNLinearMethod)
            for m in model.modules()
        )

    @staticmethod
    def applies(attn_metadata: AttentionMetadata, num_tokens: int) -> bool:
        return num_tokens == 1 and attn_metadata.num_decodes == 1

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [1] int64 -> hidden states [1, hidden_size]."""
        return self._forward(input_ids, positions)

    def compile(self) -> None:
        """Compile now (or load the compiled graph from inductor's cache), with a step that writes
        slot 0 of block 0: at start-up the cache holds nothing yet."""
        start = time.perf_counter()
        one = torch.tensor([0, 1], dtype=torch.int32)
        attn_metadata = AttentionMetadata(
            num_decodes=1,
            num_prefills=0,
            slot_mapping=torch.zeros(1, dtype=torch.int64),
            query_start_loc=one,
            seq_lens=one[1:],
            block_tables=torch.zeros(1, 1, dtype=torch.int32),
            max_query_len=1,
            max_seq_len=1,
            query_start_loc_cpu=one,
            seq_lens_cpu=one[1:],
            min_decode_seq_len=1,
        )
        with torch.inference_mode(), set_forward_context(attn_metadata):
            # Two tensors: the graph is guarded on its inputs not aliasing each other.
            self(torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))
        logger.info("compiled the one-stream decode step in %.1f s", time.perf_counter() - start)
