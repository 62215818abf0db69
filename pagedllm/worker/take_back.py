"""Moving a step planned ahead back by the rejections of the verification still in flight.

With asynchronous scheduling and speculative decoding the host plans step n + 1 before step n's
verification is known: it counts step n's drafts as accepted. Once step n has run, each request's
positions, sequence lengths and slots in step n + 1 move back by what n rejected, on the device and
without waiting for the counts (``take_back_on_device``). ``take_back_torch`` is the arithmetic in
torch (the oracle); ``kernels/triton/take_back.py`` is the one launch doing the same.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from pagedllm.worker.input_buffers import to_device
from pagedllm.worker.step_inputs import ModelInput


def take_back_torch(
    rejected: torch.Tensor,
    token_index: torch.Tensor,
    positions: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_size: int,
) -> None:
    """``take_back_on_device``'s arithmetic in torch (the oracle; kernels/triton/take_back.py is
    the one launch doing the same): each token's position and length less ``rejected[
    token_index[t]]``, its slot looked up again in its block table row. All in place."""
    per_token = rejected.index_select(0, token_index)
    positions -= per_token
    seq_lens -= per_token.to(seq_lens.dtype)
    blocks = block_tables.gather(1, (positions // block_size)[:, None].to(torch.int64))
    slot_mapping.copy_(blocks[:, 0].to(torch.int64) * block_size + positions % block_size)


TakeBack = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int], None
]


def take_back_on_device(
    model_input: ModelInput,
    rejected: torch.Tensor,
    req_index: np.ndarray,
    block_size: int,
    take_back: TakeBack = take_back_torch,
) -> None:
    """A step planned over optimistic counts (asynchronous speculation: the drafts of the step
    in flight counted as accepted), moved back by what that step rejected, on the device and
    without waiting for its counts: each request's positions, and its sequences' lengths, move
    back by ``rejected[req_index[r]]`` (``rejected`` on the device, ``req_index`` [num_reqs] in
    step order, on the host), and the slots are looked up again in the sequences' block table rows
    (``take_back``: ``take_back_torch`` or the Triton launch, chosen by the runner). For a step of
    decodes (expanded verifications included: every token a sequence of its own), without context
    parallelism or windows dropping blocks (``compute_slot_mapping``'s plain case). On the CPU the
    host's copies of the lengths are the same tensors, and their bounds are updated too."""
    offsets = model_input.req_query_start_loc
    assert offsets is not None
    num_tokens = int(offsets[-1])
    md = model_input.attn_metadata
    assert md.num_prefills == 0 and len(md.seq_lens_cpu) == num_tokens, "decodes only"
    device = rejected.device
    token_index = np.repeat(req_index.astype(np.int32), np.diff(offsets))
    take_back(
        rejected,
        to_device(token_index, device),
        model_input.positions[:num_tokens],
        md.seq_lens[:num_tokens],
        md.block_tables[:num_tokens],
        md.slot_mapping[:num_tokens],
        block_size,
    )
    if device.type == "cpu":
        md.max_seq_len = int(md.seq_lens_cpu.max())
        md.min_decode_seq_len = int(md.seq_lens_cpu.min())
