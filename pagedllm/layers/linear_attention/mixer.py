"""What every stateful token mixer (Gated DeltaNet, Mamba-2) does with the step's sequences and
their state rows: a causal conv1d over its conv channels, then a recurrence over the conv's output.

The step's sequences come as the attention metadata lays them out, decodes first. The decodes run
as one batch (``forward_method``: one token each, from their states, without a host sync, so a
CUDA graph can replay it); the prefill chunks as the step's ``PrefillPlan`` lays them out: the
conv over all of them (``conv_prefill``), each from its request's window or from zeros when it
starts at position 0 (the slot may still hold a previous owner's state), then the recurrence
(``prefill_method``). Both read and write ``conv_state`` / ``ssm_state`` (bound by
worker/state_cache.py) at the rows the step's ``attn_metadata.state_slots`` names (read from the
forward context, attention/forward_context.py).

Each implementation is chosen once for the device (a ``CustomOp``): the torch references, which
gather the rows, compute and scatter them back, a sequence at a time for prefills; or, where
Triton runs, the conv kernels (kernels/triton/causal_conv1d.py: one launch for the decodes, one
for every prefill chunk of the step), the subclass's fused decode step where it has one, and a
varlen prefill recurrence through flash-linear-attention where the subclass has one and the
package is installed (Gated DeltaNet: ``pip install pagedllm[fla]``).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import importlib.util
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from packaging.version import Version
from torch import nn

from pagedllm.attention.forward_context import get_forward_context
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.layers.custom_op import CustomOp
from pagedllm.layers.linear_attention.conv1d import causal_conv1d_prefill, causal_conv1d_update
from pagedllm.layers.linear_attention.state import LayerStateShape
from pagedllm.platform import Platform

logger = logging.getLogger(__name__)


@dataclass
class PrefillPlan:
    """The prefill chunks of one step, as every stateful layer of the step reads them: built once
    per step (``prefill_plan``), from the metadata's host copies and device tensors, with no host
    sync. Token offsets count from the first prefill token."""

    first_token: int
    lengths: list[int]
    has_state: list[bool]  # whether each chunk continues its sequence (else it starts from zeros)
    slots: torch.Tensor  # [num_chunks] int64, the chunks' state rows
    has_state_device: torch.Tensor  # [num_chunks] bool
    query_start_loc: torch.Tensor  # [num_chunks + 1] int32, from 0
    query_start_loc_cpu: torch.Tensor
    max_query_len: int
    # What an implementation derives from the plan once per step (flash-linear-attention's chunk
    # indices), by name.
    derived: dict[str, Any] = field(default_factory=dict)

    def derive(self, name: str, make: Callable[[], Any]) -> Any:
        if name not in self.derived:
            self.derived[name] = make()
        return self.derived[name]


def decode_rows() -> tuple[torch.Tensor, torch.Tensor]:
    """The running pass's decodes' state rows [num_decodes] and whether each continues its sequence
    (a one-token prompt starts from zeros): one comparison per forward pass, not one per layer
    (under a CUDA graph, the first layer's kernel computes it for every layer's)."""
    context = get_forward_context()
    md = context.attn_metadata
    n = md.num_decodes
    return context.once("decode_rows", lambda: (md.state_slots[:n], md.seq_lens[:n] > 1))


def prefill_plan() -> PrefillPlan:
    """The running pass's prefill chunks (its sequences ``num_decodes`` onwards), once per pass."""
    context = get_forward_context()
    return context.once("prefill_plan", lambda: _make_prefill_plan(context.attn_metadata))


def _make_prefill_plan(md: AttentionMetadata) -> PrefillPlan:
    nd = md.num_decodes
    starts = md.query_start_loc_cpu[nd:]
    lengths_cpu = starts[1:] - starts[:-1]
    lengths = lengths_cpu.tolist()
    first = int(starts[0])
    device_starts = md.query_start_loc[nd:]
    return PrefillPlan(
        first_token=first,
        lengths=lengths,
        has_state=(md.seq_lens_cpu[nd : md.num_seqs] > lengths_cpu).tolist(),  # tokens before the chunk
        slots=md.state_slots[nd : md.num_seqs],
        has_state_device=md.seq_lens[nd : md.num_seqs] > device_starts[1:] - device_starts[:-1],
        query_start_loc=(device_starts - first).to(torch.int32),
        query_start_loc_cpu=(starts - first).to(torch.int32),
        max_query_len=max(lengths),
    )


# The oldest flash-linear-attention whose varlen chunked rule this code calls correctly: 0.6 takes
# the V-first state (``state_v_first``); an older one would take the keyword in its **kwargs and
# read the state transposed.
FLA_MIN_VERSION = "0.6"


@functools.cache
def fla_installed() -> bool:
    """Whether flash-linear-attention (the ``fla`` package) is installed, at ``FLA_MIN_VERSION`` or
    later (looked up, not imported). An older one is passed over, with a warning, for the torch
    prefill."""
    if importlib.util.find_spec("fla") is None:
        return False
    found = None
    for distribution in ("fla-core", "flash-linear-attention"):  # 0.6 splits the kernels out
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found = importlib.metadata.version(distribution)
            break
    if found is None or Version(found) < Version(FLA_MIN_VERSION):
        logger.warning(
            "flash-linear-attention %s is older than %s: the hybrid models' prefill runs the torch "
            "path (pip install 'pagedllm[fla]')",
            found or "(version unknown)",
            FLA_MIN_VERSION,
        )
        return False
    return True


def norm_into(
    norm: Callable[..., torch.Tensor], parts: list[torch.Tensor], gate: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """``mix``'s parts through a layer's output norm, ``norm(x, gate, out=)``, each part (cast to
    out's dtype) with its tokens' rows of ``gate`` into its rows of ``out`` ([num_tokens, ...]).
    Returns out."""
    start = 0
    for part in parts:
        end = start + part.shape[0]
        norm(part.to(out.dtype), gate[start:end], out=out[start:end])
        start = end
    return out


def column_run(cols: torch.Tensor, largest: int = 128) -> int:
    """The largest power of two ``run`` from 16 up to ``largest`` such that the map ``cols`` (on
    the host) is consecutive over every aligned block of ``run`` channels and starts each at a
    multiple of 16; 1 if none. Computed once, where the map is built: the kernels take it to read
    whole blocks as vectors."""
    run = largest
    while run >= 16:
        if cols.numel() % run == 0:
            blocks = cols.view(-1, run).long()
            consecutive = bool((blocks - blocks[:, :1] == torch.arange(run, device=cols.device)).all())
            if consecutive and bool((blocks[:, 0] % 16 == 0).all()):
                return run
        run //= 2
    return 1


class StatefulMixer(CustomOp):
    """A subclass sets ``conv1d`` (its weight [conv_dim, 1, kernel] and bias, used as parameters
    only), ``state_shape``, ``conv_splits`` (the conv channels' parts the recurrence reads, summing
    to conv_dim), and the recurrence: ``_step`` over a batch of single tokens, ``_chunk`` over one
    sequence's tokens. ``inputs`` are per-token tensors ([num_tokens, ...]) beside the conv's input
    that the recurrence reads (gates, time steps).

    ``conv_input_cols``: None when the layer's conv input holds the conv's channels in order; else
    (Qwen3-Next's fused projection, whose outputs are grouped by head) an int32 buffer mapping each
    conv channel to its column of the input, which the kernels read where it lies.
    """

    conv1d: nn.Conv1d
    state_shape: LayerStateShape
    conv_splits: tuple[int, ...]
    conv_cols_run: int = 1  # column_run(conv_input_cols)
    # Whether the subclass has a fused decode step (a method ``_decode_triton``, as
    # ``_decode_torch``), and a varlen prefill through flash-linear-attention (``_prefill_fla``, as
    # ``_prefill_torch``; used where Triton runs and fla is installed).
    has_triton_decode: ClassVar[bool] = False
    has_fla_prefill: ClassVar[bool] = False

    def __init__(self) -> None:
        super().__init__()
        # This layer's rows of the state cache (bind_state): [slots + 1, ...] each.
        self.conv_state: torch.Tensor | None = None
        self.ssm_state: torch.Tensor | None = None
        self.register_buffer("conv_input_cols", None, persistent=False)

    def dispatch_forward(self, platform: Platform, dtype: torch.dtype) -> Callable[..., torch.Tensor]:
        """The decode step for the device; sets the prefill's conv (``conv_prefill``) and
        recurrence (``prefill_method``) too."""
        self.conv_prefill = self._conv_prefill_triton if platform.triton else self._conv_prefill_torch
        fused_prefill = platform.triton and self.has_fla_prefill and fla_installed()
        self.prefill_method = self._prefill_fla if fused_prefill else self._prefill_torch
        return self._decode_triton if platform.triton and self.has_triton_decode else self._decode_torch

    def bind_state(self, conv_state: torch.Tensor, ssm_state: torch.Tensor) -> None:
        assert conv_state.shape[1:] == self.state_shape.conv_shape, conv_state.shape
        assert ssm_state.shape[1:] == self.state_shape.ssm_shape, ssm_state.shape
        self.conv_state, self.ssm_state = conv_state, ssm_state

    def _step(
        self, parts: tuple[torch.Tensor, ...], inputs: tuple[torch.Tensor, ...], state: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """parts: the conv's output split by ``conv_splits``, [batch, split] each; state: [batch,
        *ssm_shape] float32 (zeros where a sequence starts). Returns (output [batch, ...], new
        state float32)."""
        raise NotImplementedError

    def _chunk(
        self, parts: tuple[torch.Tensor, ...], inputs: tuple[torch.Tensor, ...], state: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence's tokens; state None at its start. Returns (output, final state)."""
        raise NotImplementedError

    def mix(self, mixed: torch.Tensor, inputs: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        """mixed: [num_tokens, ...], the conv's input (its channels in order, or where
        ``conv_input_cols`` says). Returns the recurrence's output in parts, in the batch's order:
        the decodes' and the prefill chunks' ([tokens, ...] each; one part when the step has only
        one kind). The caller's output norm writes each part into its rows of one buffer
        (``norm_into``): concatenated here, they would cost a pass over the whole output (a
        16,384-token step of 32 heads of 128 in bf16: 134 MB read and written again per layer)."""
        md = get_forward_context().attn_metadata
        assert self.conv_state is not None and self.ssm_state is not None, "bind_state() first"
        assert md.state_slots is not None, "a hybrid model's step needs state_slots"
        outputs = []
        num_decodes = md.num_decodes
        if num_decodes:
            outputs.append(self.forward_method(mixed[:num_decodes], [x[:num_decodes] for x in inputs], md))
        if md.num_seqs > num_decodes:
            plan = prefill_plan()
            first = plan.first_token
            parts = self.conv_prefill(mixed[first:], plan)
            outputs.append(self.prefill_method(parts, tuple(x[first:] for x in inputs), plan))
        return outputs

    def _conv_input(self, mixed: torch.Tensor) -> torch.Tensor:
        """The conv's channels in order (the torch paths' copy; the kernels read in place)."""
        return mixed if self.conv_input_cols is None else mixed.index_select(1, self.conv_input_cols)

    def _conv_prefill_torch(self, mixed: torch.Tensor, plan: PrefillPlan) -> tuple[torch.Tensor, ...]:
        """The prefill chunks' conv, a sequence at a time; returns its output split by
        ``conv_splits``."""
        mixed = self._conv_input(mixed)
        weight, bias = self.conv1d.weight[:, 0], self.conv1d.bias
        conv_outs, start = [], 0
        for slot, length, keep in zip(plan.slots, plan.lengths, plan.has_state):
            conv_out, self.conv_state[slot] = causal_conv1d_prefill(
                mixed[start : start + length], weight, bias, self.conv_state[slot] if keep else None
            )
            conv_outs.append(conv_out)
            start += length
        return torch.cat(conv_outs).split(self.conv_splits, dim=-1)

    def _conv_prefill_triton(self, mixed: torch.Tensor, plan: PrefillPlan) -> tuple[torch.Tensor, ...]:
        """Every prefill chunk's conv in one kernel, its parts written contiguous."""
        from pagedllm.kernels.triton.causal_conv1d import causal_conv1d_varlen

        return causal_conv1d_varlen(
            mixed, self.conv1d.weight[:, 0], self.conv1d.bias, self.conv_state, plan.slots,
            plan.has_state_device, plan.query_start_loc, plan.max_query_len, self.conv_splits,
            cols=self.conv_input_cols, cols_run=self.conv_cols_run,
        )  # fmt: skip

    def _prefill_torch(
        self, parts: tuple[torch.Tensor, ...], inputs: tuple[torch.Tensor, ...], plan: PrefillPlan
    ) -> torch.Tensor:
        """The prefill chunks' recurrence, one sequence at a time. parts, inputs: the chunks'
        tokens, [sum(lengths), ...] each."""
        outputs, start = [], 0
        for slot, length, keep in zip(plan.slots, plan.lengths, plan.has_state):
            end = start + length
            out, self.ssm_state[slot] = self._chunk(
                tuple(x[start:end] for x in parts),
                tuple(x[start:end] for x in inputs),
                self.ssm_state[slot] if keep else None,
            )
            outputs.append(out)
            start = end
        return torch.cat(outputs)

    def _decode_torch(
        self, mixed: torch.Tensor, inputs: list[torch.Tensor], md: AttentionMetadata
    ) -> torch.Tensor:
        """mixed: [num_decodes, ...]; inputs: [num_decodes, ...] each."""
        n = md.num_decodes
        slots, has_state = decode_rows()
        conv_out, windows = causal_conv1d_update(
            self._conv_input(mixed),
            self.conv1d.weight[:, 0],
            self.conv1d.bias,
            self.conv_state[slots],
            has_state,
        )
        self.conv_state[slots] = windows.to(self.conv_state.dtype)
        # A select, not a product: a fresh sequence's slot may hold anything.
        mask = has_state.view(n, *([1] * len(self.state_shape.ssm_shape)))
        state = torch.where(mask, self.ssm_state[slots].float(), 0.0)
        out, new_state = self._step(conv_out.split(self.conv_splits, dim=-1), tuple(inputs), state)
        self.ssm_state[slots] = new_state.to(self.ssm_state.dtype)
        return out
