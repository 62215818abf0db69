"""Speculative decoding with a draft model (vLLM's ``draft_model`` method), the worker's side: a
smaller model with the target's vocabulary, run by the same worker, proposes each request's next
``k`` tokens greedily after the target's step, and the proposals travel back with the step's
samples (``ModelRunnerOutput.draft_token_ids``, which tells the scheduler to schedule them) and
stay on the device for the next step to verify (``worker/spec_decode.py: DeviceDrafts``).

**Its KV cache lives on the target's block tables.** The draft has its own K/V tensors (its own
layers, heads and head size) indexed by the SAME block ids as the target's, so the scheduler and
the KV cache manager allocate, share (prefix caching), copy, swap and free blocks once for both,
and a block's bytes in the memory budget are the target's plus the draft's. The invariant: draft
slot s holds the draft's K/V of the token whose target K/V is in slot s. It holds because

- ``prefill`` runs the draft over exactly the step's scheduled tokens with the target's
  attention metadata (same positions, same slot mapping): prompt chunks, decodes and the drafts
  being verified all get the draft's K/V where the target's go. A rejected draft's slot holds
  garbage in both caches, and both are written again when the position is recomputed; a prefix
  cache hit finds the draft's K/V beside the target's, written when the block was computed;
- block copies (copy-on-write) and swaps are applied to both caches (``run_cache_ops``).

**Proposals write only scratch blocks.** A request whose newest token t sits at position P
proposes d1 = argmax draft(t @ P), d2 = argmax draft(d1 @ P + 1), ... : k one-token decode steps
writing positions P .. P + k - 1. Those slots may not be allocated yet (the scheduler reserves the
next step's slots only when it schedules it), and writing a real block's free tail would race with
siblings sharing it. So each proposing request gets ``scratch_blocks_per_request`` private
blocks past the cache's real ones: its block containing P is copied there first (the tokens
before P in it), and the proposal steps read through a block table whose entries from P's block
on are the scratch blocks. Nothing real is written; the next step's ``prefill`` recomputes the
draft's K/V of P .. P + k (the newest token and the drafts being verified) in the real slots.

The k proposal steps run as one loop over inputs computed before it starts, replayed from a CUDA
graph per number of proposing requests where graphs are on (worker/proposal_graphs.py).

**Under tensor parallelism the draft is sharded over the target's ranks** (vLLM's choice for draft
models and EAGLE heads): built from the same parallel layers, each rank holds its shard of the
weights and its KV heads (replicated when fewer than the ranks) and runs the same prefill and
proposal steps, whose all-reduces and logits all-gather leave every rank the same argmax. The
engine reads rank 0's drafts and schedules them on every rank. Sharded, the draft's weight reads
divide over the ranks like the target's; on rank 0 alone they would not, and rank 0 would hold
fewer KV blocks than its peers, which all must match (docs/spec_decode.md, "Tensor parallelism").

Drafts are argmax tokens, a point mass: rejection sampling against them is lossless with the
verifier the n-gram method uses (sample/rejection_sampler.py), whatever the draft proposes; a
wrong or stale draft costs acceptance, never correctness.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from pagedllm.attention import bind_kv_caches, set_forward_context
from pagedllm.attention.backends.abstract import AttentionBackend
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.config import EngineConfig
from pagedllm.worker.cache_engine import CacheEngine, KVCacheSpec
from pagedllm.worker.cuda_graph import CudaGraphRunner
from pagedllm.worker.input_batch import InputBatch
from pagedllm.worker.input_buffers import to_device
from pagedllm.worker.proposal_graphs import (
    ProposalGraphs,
    ProposalInputs,
    StepPassGraphs,
    eager_steps,
    proposal_inputs,
    run_steps,
)
from pagedllm.worker.step_inputs import ModelInput


def scratch_blocks_per_request(block_size: int, num_speculative_tokens: int) -> int:
    """Blocks that positions P .. P + k - 1 span at most, whatever P's offset in its block."""
    return (block_size - 1 + num_speculative_tokens - 1) // block_size + 1


def unpadded_inputs(model_input: ModelInput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """The step's (input_ids, positions, attention metadata) without a CUDA graph's padding: a
    graph-replayed target ran on inputs padded to its batch size; drafts run eagerly on the real
    rows (decodes only: one token each)."""
    input_ids, positions, metadata = model_input.input_ids, model_input.positions, model_input.attn_metadata
    n = model_input.graph_num_seqs
    if n is None:
        return input_ids, positions, metadata
    metadata = dataclasses.replace(
        metadata,
        slot_mapping=metadata.slot_mapping[:n],
        query_start_loc=metadata.query_start_loc[: n + 1],
        seq_lens=metadata.seq_lens[:n],
        block_tables=metadata.block_tables[:n],
        query_start_loc_cpu=metadata.query_start_loc_cpu[: n + 1],
        seq_lens_cpu=metadata.seq_lens_cpu[:n],
        decode_query_lens=None if metadata.decode_query_lens is None else metadata.decode_query_lens[:n],
    )
    return input_ids[:n], positions[:n], metadata


@dataclass
class NewestPositions:
    """Where each proposing request's newest token sits: ``host`` ([num_reqs] int64), plus, for
    the last ``len(accepted)`` requests (those whose step verified drafts), the drafts each
    accepted (``accepted``: int64 on the device; None when every position is on the host). A
    verification's counts reach the host one step later: the drafter adds them on the device and
    does not wait for them (worker/spec_decode.py)."""

    host: np.ndarray
    accepted: torch.Tensor | None = None
    _device: torch.Tensor | None = field(default=None, init=False, repr=False)

    def on_device(self, device: torch.device) -> torch.Tensor:
        """[num_reqs] int64 on ``device`` (made once: the drafter reads it more than once)."""
        if self._device is None:
            # A copy of ``host`` (astype copies): on the CPU the tensor would share its memory.
            self._device = to_device(self.host.astype(np.int64), device)
            if self.accepted is not None and len(self.accepted):
                self._device[len(self.host) - len(self.accepted) :] += self.accepted
        return self._device


class DraftModelRunner:
    """The draft model and its KV cache, beside the target's ``ModelRunner``.

    Args:
        config: the engine's configuration (``draft_model_config`` set).
        attn_backend: the target's backend class, which the draft's layers use too.
        input_batch: the target runner's persistent batch (block tables, newest tokens).
    """

    # A proposal writes the draft's K/V for the positions it drafts from, which later steps read:
    # it runs every step, whether or not the scheduler verifies drafts at that batch size.
    proposes_statelessly = False

    def __init__(
        self, config: EngineConfig, attn_backend: type[AttentionBackend], input_batch: InputBatch
    ) -> None:
        spec_config = config.speculative_config
        assert spec_config is not None and config.draft_model_config is not None
        self.model_config = draft = config.draft_model_config
        # Dummy weights for both (benchmarks), else the draft's own format (a GGUF file or not).
        self.load_format = "dummy" if config.load_config.load_format == "dummy" else "auto"
        self.device = config.device_config.device
        self.attn_backend = attn_backend
        self.batch = input_batch
        self.num_speculative_tokens = spec_config.num_speculative_tokens
        self.block_size = block_size = config.cache_config.block_size
        self.max_model_len = config.model_config.max_model_len
        attn_backend.check_model_supported(draft, block_size, self.device)
        self.kv_cache_spec = KVCacheSpec(
            num_layers=draft.num_layers,
            num_kv_heads=draft.num_kv_heads_per_rank(config.parallel_config.tensor_parallel_size),
            head_size=draft.head_size,
            block_size=block_size,
            dtype=draft.dtype,
            keys_only=draft.is_mla,
        )
        # Every request that samples in a step may propose (at most max_num_seqs sequences run).
        self.scratch_per_request = scratch_blocks_per_request(block_size, self.num_speculative_tokens)
        self.max_num_proposals = config.scheduler_config.max_num_seqs
        self.num_scratch_blocks = self.max_num_proposals * self.scratch_per_request
        self.model: nn.Module | None = None
        self.cache_engine: CacheEngine | None = None
        self.first_scratch_block = 0  # the cache's real blocks come first (initialize_cache)
        # The proposal loop's CUDA graphs (capture_graphs, with the target's); None: eager.
        self.graphs: ProposalGraphs | None = None
        # The pass over a step's tokens, replayed when the target's step replayed a graph (on
        # the target graphs' buffers: ``target_graphs``); None: eager.
        self.pass_graphs: StepPassGraphs | None = None
        self.target_graphs: CudaGraphRunner | None = None

    @property
    def block_bytes(self) -> int:
        """The draft's bytes per block, added to the target's in the cache budget."""
        return self.kv_cache_spec.block_bytes

    @property
    def scratch_bytes(self) -> int:
        """The proposals' scratch blocks, taken from the budget before it is cut into blocks."""
        return self.num_scratch_blocks * self.block_bytes

    def load_model(self, target: nn.Module) -> None:
        """The draft's weights (``target``, already loaded, is the EAGLE heads' to read)."""
        from pagedllm.model_loader import get_model

        self.model = get_model(self.model_config, self.load_format, self.device, self.attn_backend)

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        """The draft's cache, bound to its layers: the target's block ids, then the scratch blocks."""
        assert self.model is not None
        self.cache_engine = CacheEngine(
            self.kv_cache_spec,
            self.attn_backend,
            num_gpu_blocks + self.num_scratch_blocks,
            num_cpu_blocks,
            self.device,
        )
        self.first_scratch_block = num_gpu_blocks
        bind_kv_caches(self.model, self.cache_engine.gpu_cache)

    def run_cache_ops(self, *block_moves: list[tuple[int, int]]) -> None:
        """The target's block moves (``CacheEngine.run_cache_ops``'s arguments), on the draft's
        cache too (the invariant above)."""
        if self.cache_engine is not None:
            self.cache_engine.run_cache_ops(*block_moves)

    @property
    def ready(self) -> bool:
        """False until the cache exists (the memory profile runs the target alone)."""
        return self.cache_engine is not None

    def prefill(self, model_input: ModelInput, hidden_states: torch.Tensor) -> None:
        """The draft's forward over the step's scheduled tokens, writing its K/V into the slots
        the target's went to (the target's ``hidden_states`` are not needed): on the target
        graph's inputs when it replayed one."""
        assert self.model is not None and self.cache_engine is not None
        if model_input.graph_num_seqs is not None and self.pass_graphs is not None:
            self.pass_graphs.replay(model_input.graph_num_seqs)
            return
        input_ids, positions, metadata = unpadded_inputs(model_input)
        with set_forward_context(metadata):
            self.model(input_ids, positions)

    def _step_pass(self, batch_size: int) -> tuple[torch.Tensor, ...]:
        """``StepPass``: the draft over the target graphs' input buffers."""
        assert self.model is not None and self.target_graphs is not None
        buffers = self.target_graphs.buffers
        input_ids, positions = (buffers.device_view(name, batch_size) for name in ("input_ids", "positions"))
        return (self.model(input_ids, positions),)

    def propose(self, rows: np.ndarray, newest: NewestPositions) -> tuple[np.ndarray, torch.Tensor]:
        """After the target's samples are recorded: ``k`` greedy drafts for the requests in batch
        ``rows``, continuing each one's newest token (``last_token_ids``, on the device) at its
        position ``newest``. Returns the rows proposed for and their drafts, [num_rows, k] int64
        on the device."""
        assert self.model is not None and self.cache_engine is not None
        num_reqs = min(len(rows), self.max_num_proposals)
        rows = rows[:num_reqs]
        if not num_reqs:
            return rows, self.no_proposals()
        tokens = self.batch.last_token_ids.index_select(0, to_device(rows, self.device))
        return rows, self._run_proposals(tokens, None, rows, newest)

    def no_proposals(self) -> torch.Tensor:
        return torch.empty((0, self.num_speculative_tokens), dtype=torch.int64, device=self.device)

    def _step(
        self, tokens: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One proposal step (``ProposalStep``): the draft's argmax after ``tokens``."""
        assert self.model is not None
        return self.model.compute_logits(self.model(tokens, positions)).argmax(dim=-1), None

    @property
    def num_proposal_steps(self) -> int:
        """One-token steps per proposal loop: all k drafts."""
        return self.num_speculative_tokens

    @property
    def proposal_hidden(self) -> tuple[int, torch.dtype]:
        """The hidden input a proposal step carries (size 0: none)."""
        return 0, self.model_config.dtype

    def capture_graphs(self, capture_sizes: list[int], target_graphs: CudaGraphRunner) -> None:
        """Capture the proposal loop per number of proposing requests (worker/proposal_graphs.py),
        over the bound cache (more requests than the largest size propose eagerly), and the pass
        over a step's tokens per size of the target's decode graphs."""
        if self.num_proposal_steps:
            self.graphs = self.proposal_graphs(capture_sizes)
            self.graphs.capture()
        self.target_graphs = target_graphs
        sizes = target_graphs.capture_sizes
        self.pass_graphs = StepPassGraphs(self._step_pass, target_graphs.metadata, sizes)
        self.pass_graphs.capture()

    def proposal_graphs(self, capture_sizes: list[int]) -> ProposalGraphs:
        """The proposal loop's static buffers for up to ``max(capture_sizes)`` requests, before any
        capture (without one, the loop runs on them eagerly)."""
        return ProposalGraphs(
            self._step,
            self._prepare_proposals,
            self.num_proposal_steps,
            capture_sizes,
            self.proposal_hidden,
            self.batch.block_table.shape[1],
            self.max_model_len,
            self.device,
        )

    def _run_proposals(
        self, tokens: torch.Tensor, hidden: torch.Tensor | None, rows: np.ndarray, newest: NewestPositions
    ) -> torch.Tensor:
        """The proposal loop from ``tokens`` [B] (and ``hidden`` [B, H]) of the requests in batch
        ``rows`` (the first of ``newest``'s): [B, S] drafts (device), replayed with its
        preparation from a graph where one was captured for B requests."""
        positions = newest.on_device(self.device)[: len(rows)]
        block_tables = to_device(self.batch.block_table[rows], self.device)
        graphs = self.graphs
        if graphs is not None and tokens.shape[0] <= graphs.max_batch_size:
            return graphs.run(tokens, hidden, block_tables, positions)
        inputs = self._prepare_proposals(block_tables, positions, None)
        drafts = torch.empty((tokens.shape[0], inputs.num_steps), dtype=torch.int64, device=self.device)
        run_steps(self._step, tokens, hidden, eager_steps(inputs), drafts)
        return drafts

    def _prepare_proposals(
        self, block_tables: torch.Tensor, newest: torch.Tensor, valid: torch.Tensor | None
    ) -> ProposalInputs:
        """``ProposalPrepare``: the loop's inputs for requests of ``block_tables`` ([B, W] int32,
        their own) from their newest tokens' positions P ([B] int64), through scratch tables:
        each request's own up to the block holding P, its scratch blocks from there on, that
        block's contents copied into the first. All on the device: P may not have reached the
        host, and under a graph this is part of the replay."""
        num_reqs, per_request = block_tables.shape[0], self.scratch_per_request
        table = torch.nn.functional.pad(block_tables.long(), (0, per_request))
        first_block = (newest // self.block_size)[:, None]
        scratch = self.first_scratch_block + torch.arange(
            num_reqs * per_request, dtype=torch.int64, device=self.device
        ).view(num_reqs, per_request)
        src_index = table.gather(1, first_block)[:, 0]
        table.scatter_(1, first_block + torch.arange(per_request, device=self.device), scratch)
        dst_index = scratch[:, 0]
        assert self.cache_engine is not None
        for layer in self.cache_engine.gpu_cache:
            for tensor in {id(t): t for t in layer}.values():  # once when K is V (MLA)
                tensor.index_copy_(0, dst_index, tensor.index_select(0, src_index))
        steps = self.num_proposal_steps
        return proposal_inputs(
            table.to(torch.int32), newest, steps, self.block_size, self.max_model_len, valid
        )
