"""The step's input tensors at fixed device addresses, filled through pinned host staging.

On a GPU every step's inputs (token ids, positions, slot mapping, sequence lengths, query
offsets, block tables) are written into the same preallocated device tensors: each costs one
asynchronous host-to-device copy from pinned memory, no allocation, and a captured CUDA graph can
read them at the addresses it was captured with. On the CPU the arrays are used as they are.
"""

from __future__ import annotations

import numpy as np
import torch


class InputBuffers:
    """Args:
    max_num_tokens: most tokens in a step (max_num_batched_tokens, or the largest CUDA graph).
    max_num_seqs: most sequences in a step.
    max_blocks_per_seq: block table width: blocks of a max_model_len sequence.
    """

    def __init__(
        self, max_num_tokens: int, max_num_seqs: int, max_blocks_per_seq: int, device: torch.device
    ) -> None:
        self.device = device
        self.on_host = device.type == "cpu"
        self.max_num_tokens = max_num_tokens
        sizes = {
            "input_ids": (max_num_tokens, torch.int64),
            "positions": (max_num_tokens, torch.int64),
            "slot_mapping": (max_num_tokens, torch.int64),
            "seq_lens": (max_num_seqs, torch.int32),
            "query_start_loc": (max_num_seqs + 1, torch.int32),
            # Rows of the persistent batch, and where decode inputs come from the device.
            "req_rows": (max_num_seqs, torch.int64),
            "device_input_index": (max_num_seqs, torch.int64),
            "device_input_rows": (max_num_seqs, torch.int64),
            # Recurrent-state rows of hybrid models (-1: the scratch row).
            "state_slots": (max_num_seqs, torch.int64),
            # Query groups of expanded verifications (AttentionMetadata.decode_query_lens).
            "decode_query_lens": (max_num_seqs, torch.int32),
        }
        if self.on_host:
            return
        self._device = {name: torch.zeros(n, dtype=t, device=device) for name, (n, t) in sizes.items()}
        shape = (max_num_seqs, max_blocks_per_seq)
        self._device["block_tables"] = torch.zeros(shape, dtype=torch.int32, device=device)

    def put(self, name: str, array: np.ndarray, pad_to: int = 0, pad_value: int = 0) -> torch.Tensor:
        """The device tensor holding ``array`` (its first ``max(len(array), pad_to)`` rows; rows past
        the array hold ``pad_value``). Block tables keep their full width: only the rows change.

        The staging copy is a fresh pinned tensor from torch's caching host allocator, which does
        not hand it out again before its copy has run: with asynchronous scheduling the host fills
        the next step's inputs while the device may not yet have read this step's.
        """
        if self.on_host:
            return torch.from_numpy(array)
        num_rows = max(len(array), pad_to)
        device = self._device[name][:num_rows]
        host = torch.empty(device.shape, dtype=device.dtype, pin_memory=True)
        fill_staging(host, array, pad_value)
        device.copy_(host, non_blocking=True)
        return device

    def device_view(self, name: str, num_rows: int) -> torch.Tensor:
        """The first rows of a device buffer, as a captured graph reads them."""
        return self._device[name][:num_rows]


def fill_staging(host: torch.Tensor, array: np.ndarray, pad_value: int) -> None:
    """Write ``array`` into the first rows of the staging tensor ``host`` and ``pad_value`` into the
    rows past it (a CUDA graph's padding). A 2-D array fills its own columns only: a block table
    keeps the buffer's full width, of which a step writes the blocks its sequences use."""
    if array.ndim == 2:
        host[: len(array), : array.shape[1]] = torch.from_numpy(array)
    else:
        host[: len(array)] = torch.from_numpy(array)
    host[len(array) :] = pad_value


def to_device(
    array: np.ndarray | list, device: torch.device, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """A host array on ``device`` without a host sync: through pinned memory, asynchronously.

    A copy from pageable memory would first wait for the device's stream to drain (CUDA's rule
    for pageable transfers), which would end the overlap of host and device work.
    """
    tensor = torch.as_tensor(array, dtype=dtype)
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


def to_host(
    tensors: list[torch.Tensor], first_fill: int | None = None
) -> tuple[list[torch.Tensor], torch.cuda.Event | None]:
    """Device tensors on their way to the host without a host sync: one non-blocking copy each
    into pinned memory, then an event that the reader waits on (None on the CPU, where the
    tensors are returned as they are). ``first_fill``: the first host tensor holds this value
    until its copy lands (filled before the copy is queued)."""
    if not tensors or tensors[0].device.type != "cuda":
        return tensors, None
    host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    if first_fill is not None:
        host[0].fill_(first_fill)
    for copy, tensor in zip(host, tensors):
        copy.copy_(tensor, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return host, event
