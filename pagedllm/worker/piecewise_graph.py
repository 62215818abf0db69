"""Steps that compute prompt tokens, replayed from CUDA graphs cut at every attention call (vLLM's
piecewise CUDA graphs, without torch.compile).

A step of decodes replays one graph of the whole forward (cuda_graph.py). A step with prompt
tokens cannot: its attention's launches depend on how the tokens divide into sequences, which
changes every step. Everything else in a layer (norms, projections, the MLP or the experts, the
residual adds) depends on the number of tokens alone. So for each size in ``capture_sizes`` the
forward is captured as a chain of graphs cut at the attention calls: graph 0 runs up to the first
layer's attention inputs, the attention runs eagerly with the step's metadata and its output is
copied into a fixed buffer, graph 1 runs from that buffer to the next attention's inputs, and so
on to the final hidden states. A step of T tokens replays the smallest size >= T. Its rows past T
hold stale inputs whose outputs nobody reads: rows do not mix outside attention, and the attention
sees the step's T tokens only.

What it saves is host time. Eagerly, a step launches every kernel from Python (about 15 a layer,
tens of microseconds each with Triton's launcher); here it launches one graph a layer plus the
attention's own kernels. That matters where steps are short: a small model, or a step of a few new
prompts beside a running batch, which is what decodes ending at different times (speculation,
online arrivals) produce.

Capture: the layers' ``attend`` (the one call every ``Attention.forward`` makes) is swapped, for
the capture only, for a splitter that ends the graph being captured, runs the real attention
eagerly, remembers its inputs and output, and begins the next graph. Every graph of every size is
captured into one memory pool, largest size first; the graphs of one size replay in the order they
were captured, which is what graphs sharing a pool need, and one size's chain runs at a time.
Inputs come from ``InputBuffers``, as for the decode graphs.

Which models: those whose only metadata-dependent operation is ``Attention``: no recurrent state
(its mixers read the step's metadata), no multi-head latent attention (its own attention call), one
rank (the custom all-reduce registers its graph buffers for the decode capture alone), one
pipeline stage, no context parallelism, no LoRA (its indices are staged for the decode graphs'
padding), and no EAGLE or MTP head (they read the target's intermediate hidden states).
``unsupported_reason`` says which of these rules a configuration breaks.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pagedllm.attention.forward_context import set_forward_context
from pagedllm.attention.layer import Attention
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.config import EngineConfig
from pagedllm.worker.input_buffers import InputBuffers

logger = logging.getLogger(__name__)

# Steps up to this many tokens replay a chain; larger ones are bound by their GEMMs, where launching
# kernels one by one costs little, and run eagerly.
MAX_PIECEWISE_TOKENS = 2048
# Sizes a step's tokens are padded to: powers of two where a step is mostly launches, then at most
# half again as many rows as the step has (past 128 tokens), where its GEMMs begin to count.
_SIZES = (16, 32, 64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)
# Speculative methods whose drafter reads the target's intermediate hidden states.
_HIDDEN_STATE_METHODS = ("eagle", "eagle3", "mtp")


def piecewise_capture_sizes(max_num_batched_tokens: int) -> list[int]:
    """The chain sizes for steps of up to ``max_num_batched_tokens`` tokens (and at most
    ``MAX_PIECEWISE_TOKENS``)."""
    sizes = [s for s in _SIZES if s <= max_num_batched_tokens]
    if max_num_batched_tokens < MAX_PIECEWISE_TOKENS and (not sizes or sizes[-1] < max_num_batched_tokens):
        sizes.append(max_num_batched_tokens)
    return sizes


def unsupported_reason(config: EngineConfig) -> str | None:
    """Why ``config``'s steps with prompt tokens cannot replay piecewise graphs, or None."""
    model, parallel = config.model_config, config.parallel_config
    spec = config.speculative_config
    reasons = (
        (model.has_recurrent_state, "its recurrent layers read the step's metadata"),
        (model.is_mla, "multi-head latent attention attends outside the Attention layer"),
        (parallel.tensor_parallel_size > 1, "tensor_parallel_size > 1"),
        (parallel.pipeline_parallel_size > 1, "pipeline_parallel_size > 1"),
        (parallel.context_parallel_size > 1, "context_parallel_size > 1"),
        (config.lora_config is not None, "enable_lora"),
        (spec is not None and spec.method in _HIDDEN_STATE_METHODS, "a drafter that reads hidden states"),
    )
    return next((why for broken, why in reasons if broken), None)


def stand_in_metadata(
    size: int, max_model_len: int, block_size: int, device: torch.device
) -> AttentionMetadata:
    """What the capture's eager attention calls see: ``size`` prompt tokens in sequences of up to
    ``max_model_len``, writing nothing (slot -1) and reading block 0 only. Attention is not in the
    graphs, so these tensors need no fixed address; the values it computes are never read."""
    lengths = [min(max_model_len, size - start) for start in range(0, size, max_model_len)]
    query_start_loc = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    width = -(-max(lengths) // block_size)
    return AttentionMetadata(
        num_decodes=0,
        num_prefills=len(lengths),
        slot_mapping=torch.full((size,), -1, dtype=torch.int64, device=device),
        query_start_loc=query_start_loc.to(device),
        seq_lens=seq_lens.to(device),
        block_tables=torch.zeros((len(lengths), width), dtype=torch.int32, device=device),
        max_query_len=max(lengths),
        max_seq_len=max(lengths),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens,
    )


def piecewise_sizes_for(config: EngineConfig) -> list[int]:
    """The chain sizes ``config`` asks for and allows (none, with a one-line reason, where its
    model cannot follow: ``unsupported_reason``)."""
    if config.enforce_eager or config.cudagraph_mode != "FULL_AND_PIECEWISE":
        return []
    reason = unsupported_reason(config)
    if reason is not None:
        logger.warning("cudagraph_mode FULL_AND_PIECEWISE: steps with prompt tokens run eagerly (%s)", reason)
        return []
    return piecewise_capture_sizes(config.scheduler_config.max_num_batched_tokens)


class _Piece:
    """One eager attention call between two graphs: its layer's ``attend`` and the fixed tensors
    it reads and writes (views at the chain's size)."""

    __slots__ = ("attend", "key", "kv_cache", "output", "positions", "query", "sink_query", "value")

    def __init__(self, attend: Callable[..., torch.Tensor], args: tuple, options: dict, output: torch.Tensor):
        self.attend = attend
        self.query, self.key, self.value, self.kv_cache = args
        self.sink_query = options.get("sink_query")
        self.positions = options.get("positions")
        self.output = output

    def run(self, num_tokens: int, metadata: AttentionMetadata) -> None:
        n = num_tokens
        result = self.attend(
            self.query[:n],
            self.key[:n],
            self.value[:n],
            self.kv_cache,
            metadata,
            sink_query=None if self.sink_query is None else self.sink_query[:n],
            positions=None if self.positions is None else self.positions[:n],
        )
        self.output[:n].copy_(result)


class _ChainCapture:
    """Captures one forward as graphs cut at the attention calls (see the module docstring).

    Every attention call of every chain writes its output into the front of one buffer,
    ``out_buffer`` (elements: the largest size times the widest layer's heads): a graph reads the
    output of the attention before it, which the next attention overwrites only after that graph
    ran, and one chain runs at a time. Outputs of their own would cost every layer a
    [size, heads * head_size] tensor per size."""

    def __init__(self, pool: Any, out_buffer: Callable[[torch.dtype], torch.Tensor]) -> None:
        self.pool = pool
        self.out_buffer = out_buffer
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.pieces: list[_Piece] = []

    def begin(self) -> None:
        self.graphs.append(torch.cuda.CUDAGraph())
        self.graphs[-1].capture_begin(pool=self.pool)

    def end(self) -> None:
        self.graphs[-1].capture_end()

    def splitter(self, attend: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def split(*args: Any, **options: Any) -> torch.Tensor:
            query, key, value, kv_cache, metadata = args
            self.end()
            result = attend(query, key, value, kv_cache, metadata, **options)
            output = self.out_buffer(result.dtype)[: result.numel()].view(result.shape)
            output.copy_(result)
            self.pieces.append(_Piece(attend, (query, key, value, kv_cache), options, output))
            self.begin()
            return output

        return split


class PiecewiseGraphRunner:
    """The chains of every size in ``capture_sizes``, captured over the bound KV caches.

    Args:
        model: the model, its caches bound.
        buffers: the model runner's input buffers (input ids and positions are read from them).
        capture_sizes: the chain sizes (``piecewise_capture_sizes``).
        max_model_len, block_size: the bounds of the capture's stand-in metadata
            (``stand_in_metadata``).
    """

    def __init__(
        self,
        model: nn.Module,
        buffers: InputBuffers,
        capture_sizes: list[int],
        max_model_len: int,
        block_size: int,
    ) -> None:
        self.model = model
        self.buffers = buffers
        self.capture_sizes = sorted(capture_sizes)
        self.max_model_len = max_model_len
        self.block_size = block_size
        self._chains: dict[int, tuple[list[torch.cuda.CUDAGraph], list[_Piece], torch.Tensor]] = {}
        self._out: torch.Tensor | None = None  # _ChainCapture's shared attention output

    @property
    def max_num_tokens(self) -> int:
        return self.capture_sizes[-1]

    def padded_size(self, num_tokens: int) -> int:
        return self.capture_sizes[bisect.bisect_left(self.capture_sizes, num_tokens)]

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        widest = max(layer.num_heads * layer.head_size for layer in layers)

        def out_buffer(dtype: torch.dtype) -> torch.Tensor:
            if self._out is None:
                self._out = torch.empty(self.max_num_tokens * widest, dtype=dtype, device=stream.device)
            assert self._out.dtype == dtype, "attention layers of different output dtypes"
            return self._out

        for size in reversed(self.capture_sizes):
            input_ids = self.buffers.device_view("input_ids", size)
            positions = self.buffers.device_view("positions", size)
            metadata = stand_in_metadata(size, self.max_model_len, self.block_size, input_ids.device)
            # Warm-up runs compile the kernels' specialisations for this size outside the capture.
            for _ in range(2):
                with set_forward_context(metadata):
                    self.model(input_ids, positions)
            torch.cuda.synchronize()
            chain = _ChainCapture(pool, out_buffer)
            attends = [layer.attend for layer in layers]
            for layer, attend in zip(layers, attends):
                layer.attend = chain.splitter(attend)
            stream.wait_stream(torch.cuda.current_stream())
            try:
                with set_forward_context(metadata), torch.cuda.stream(stream):
                    chain.begin()
                    output = self.model(input_ids, positions)
                    chain.end()
            finally:
                for layer, attend in zip(layers, attends):
                    layer.attend = attend
            torch.cuda.current_stream().wait_stream(stream)
            if len(chain.pieces) != len(layers):
                raise RuntimeError(
                    f"piecewise capture: the forward called attention {len(chain.pieces)} times, "
                    f"for {len(layers)} attention layers"
                )
            self._chains[size] = (chain.graphs, chain.pieces, output)
        torch.cuda.synchronize()
        logger.info(
            "captured piecewise CUDA graphs for steps of up to %d tokens (%d sizes, %d graphs each) "
            "in %.1f s",
            self.max_num_tokens,
            len(self._chains),
            len(layers) + 1,
            time.perf_counter() - start,
        )

    def replay(self, num_tokens: int, metadata: AttentionMetadata) -> torch.Tensor:
        """The forward over the step's ``num_tokens`` tokens, already in the input buffers, its
        attention under ``metadata``. Returns their final hidden states: [num_tokens, hidden]."""
        graphs, pieces, output = self._chains[self.padded_size(num_tokens)]
        graphs[0].replay()
        for piece, graph in zip(pieces, graphs[1:]):
            piece.run(num_tokens, metadata)
            graph.replay()
        return output[:num_tokens]
