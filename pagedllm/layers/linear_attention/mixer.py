"""What every stateful token mixer (Gated DeltaNet, Mamba-2) does with the step's sequences and
their state rows: a causal conv1d over its conv channels, then a recurrence over the conv's output.

The step's sequences come as the attention metadata lays them out, decodes first. The decodes run
as one batch (``_step``: one token each, from their states, without a host sync, so a CUDA graph
can replay it); each prefill chunk runs on its own (``_chunk``) from its request's state, or from
zeros when it starts at position 0 (the slot may still hold a previous owner's state). Both read
and write ``conv_state`` / ``ssm_state`` (bound by worker/state_cache.py) at the rows the step's
``attn_metadata.state_slots`` names (read from the forward context, attention/forward_context.py).

The decode step is chosen once for the device (a ``CustomOp``: ``forward_method`` is the decode
step here): the torch reference, which gathers the rows, steps and scatters them back, or, where
Triton runs and the layer has them, its fused kernels, which update the rows in place. So is the
prefill recurrence (``prefill_method``): the torch reference, a chunk at a time, or one varlen call
of flash-linear-attention's chunked kernels over every chunk of the step (Gated DeltaNet on CUDA,
with the ``fla`` package installed: ``pip install pagedllm[fla]``).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import ClassVar

import torch
from torch import nn

from pagedllm.attention.forward_context import get_forward_context
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.layers.custom_op import CustomOp
from pagedllm.layers.linear_attention.conv1d import causal_conv1d_prefill, causal_conv1d_update
from pagedllm.layers.linear_attention.state import LayerStateShape
from pagedllm.platform import Platform


def fla_installed() -> bool:
    """Whether flash-linear-attention (the ``fla`` package) is installed (looked up, not imported)."""
    return importlib.util.find_spec("fla") is not None


class StatefulMixer(CustomOp):
    """A subclass sets ``conv1d`` (its weight [conv_dim, 1, kernel] and bias, used as parameters
    only), ``state_shape``, and the recurrence: ``_step`` over a batch of single tokens, ``_chunk``
    over one sequence's tokens. ``inputs`` are per-token tensors ([num_tokens, ...]) beside the
    conv's output that the recurrence reads (decays, write strengths, time steps)."""

    conv1d: nn.Conv1d
    state_shape: LayerStateShape
    # Whether the subclass has fused decode kernels (a method ``_decode_triton``, as
    # ``_decode_torch``), and a varlen prefill through flash-linear-attention (``_prefill_fla``, as
    # ``_prefill_torch``; used where Triton runs and fla is installed).
    has_triton_decode: ClassVar[bool] = False
    has_fla_prefill: ClassVar[bool] = False

    def __init__(self) -> None:
        super().__init__()
        # This layer's rows of the state cache (bind_state): [slots + 1, ...] each.
        self.conv_state: torch.Tensor | None = None
        self.ssm_state: torch.Tensor | None = None

    def dispatch_forward(self, platform: Platform, dtype: torch.dtype) -> Callable[..., torch.Tensor]:
        """The decode step for the device; sets the prefill recurrence (``prefill_method``) too."""
        fused_prefill = platform.triton and self.has_fla_prefill and fla_installed()
        self.prefill_method = self._prefill_fla if fused_prefill else self._prefill_torch
        return self._decode_triton if platform.triton and self.has_triton_decode else self._decode_torch

    def bind_state(self, conv_state: torch.Tensor, ssm_state: torch.Tensor) -> None:
        assert conv_state.shape[1:] == self.state_shape.conv_shape, conv_state.shape
        assert ssm_state.shape[1:] == self.state_shape.ssm_shape, ssm_state.shape
        self.conv_state, self.ssm_state = conv_state, ssm_state

    def _step(
        self, conv_out: torch.Tensor, inputs: tuple[torch.Tensor, ...], state: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """conv_out: [batch, conv_dim]; state: [batch, *ssm_shape] float32 (zeros where a sequence
        starts). Returns (output [batch, ...] float32, new state)."""
        raise NotImplementedError

    def _chunk(
        self, conv_out: torch.Tensor, inputs: tuple[torch.Tensor, ...], state: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence's tokens; state None at its start. Returns (output, final state)."""
        raise NotImplementedError

    def mix(self, mixed: torch.Tensor, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """mixed: [num_tokens, conv_dim], the conv's input. Returns the recurrence's output for
        every token, [num_tokens, ...] float32, in the batch's order."""
        md = get_forward_context().attn_metadata
        assert self.conv_state is not None and self.ssm_state is not None, "bind_state() first"
        assert md.state_slots is not None, "a hybrid model's step needs state_slots"
        weight, bias = self.conv1d.weight[:, 0], self.conv1d.bias
        outputs = []
        num_decodes = md.num_decodes
        if num_decodes:
            outputs.append(self.forward_method(mixed[:num_decodes], [x[:num_decodes] for x in inputs], md))
        if md.num_seqs > num_decodes:
            query_start_loc, seq_lens = md.query_start_loc_cpu.tolist(), md.seq_lens_cpu.tolist()
            lengths, has_state, conv_outs = [], [], []
            for i in range(num_decodes, md.num_seqs):
                start, end = query_start_loc[i], query_start_loc[i + 1]
                slot = md.state_slots[i]
                lengths.append(end - start)
                has_state.append(seq_lens[i] > end - start)  # tokens before this chunk
                conv_out, self.conv_state[slot] = causal_conv1d_prefill(
                    mixed[start:end], weight, bias, self.conv_state[slot] if has_state[-1] else None
                )
                conv_outs.append(conv_out)
            first = query_start_loc[num_decodes]
            outputs.append(
                self.prefill_method(
                    torch.cat(conv_outs),
                    tuple(x[first:] for x in inputs),
                    lengths,
                    md.state_slots[num_decodes:],
                    has_state,
                )
            )
        return torch.cat(outputs) if len(outputs) > 1 else outputs[0]

    def _prefill_torch(
        self,
        conv_out: torch.Tensor,
        inputs: tuple[torch.Tensor, ...],
        lengths: list[int],
        slots: torch.Tensor,
        has_state: list[bool],
    ) -> torch.Tensor:
        """The prefill chunks' recurrence, one sequence at a time. conv_out, inputs: the chunks'
        tokens, [sum(lengths), ...]; slots: [num_chunks]; has_state: whether each chunk continues
        its sequence (else it starts from zeros)."""
        outputs, start = [], 0
        for slot, length, keep in zip(slots, lengths, has_state):
            end = start + length
            out, self.ssm_state[slot] = self._chunk(
                conv_out[start:end],
                tuple(x[start:end] for x in inputs),
                self.ssm_state[slot] if keep else None,
            )
            outputs.append(out)
            start = end
        return torch.cat(outputs)

    def _decode_torch(
        self, mixed: torch.Tensor, inputs: list[torch.Tensor], md: AttentionMetadata
    ) -> torch.Tensor:
        """mixed: [num_decodes, conv_dim]; inputs: [num_decodes, ...] each."""
        n = md.num_decodes
        slots = md.state_slots[:n]
        has_state = md.seq_lens[:n] > 1  # a one-token prompt starts from zeros
        conv_out, self.conv_state[slots] = causal_conv1d_update(
            mixed, self.conv1d.weight[:, 0], self.conv1d.bias, self.conv_state[slots], has_state
        )
        # A select, not a product: a fresh sequence's slot may hold anything.
        mask = has_state.view(n, *([1] * len(self.state_shape.ssm_shape)))
        state = torch.where(mask, self.ssm_state[slots].float(), 0.0)
        out, new_state = self._step(conv_out, tuple(inputs), state)
        self.ssm_state[slots] = new_state.to(self.ssm_state.dtype)
        return out
