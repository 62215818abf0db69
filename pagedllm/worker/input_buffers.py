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
        sizes = {
            "input_ids": (max_num_tokens, torch.int64),
            "positions": (max_num_tokens, torch.int64),
            "slot_mapping": (max_num_tokens, torch.int64),
            "seq_lens": (max_num_seqs, torch.int32),
            "query_start_loc": (max_num_seqs + 1, torch.int32),
        }
        if self.on_host:
            return
        self._host = {name: torch.zeros(n, dtype=t, pin_memory=True) for name, (n, t) in sizes.items()}
        self._device = {name: torch.zeros(n, dtype=t, device=device) for name, (n, t) in sizes.items()}
        shape = (max_num_seqs, max_blocks_per_seq)
        self._host["block_tables"] = torch.zeros(shape, dtype=torch.int32, pin_memory=True)
        self._device["block_tables"] = torch.zeros(shape, dtype=torch.int32, device=device)

    def put(self, name: str, array: np.ndarray, pad_to: int = 0, pad_value: int = 0) -> torch.Tensor:
        """The device tensor holding ``array`` (its first ``max(len(array), pad_to)`` rows; rows past
        the array hold ``pad_value``). Block tables keep their full width: only the rows change."""
        if self.on_host:
            return torch.from_numpy(array)
        num_rows = max(len(array), pad_to)
        host = self._host[name][:num_rows]
        if array.ndim == 2:
            host[: len(array), : array.shape[1]] = torch.from_numpy(array)
        else:
            host[: len(array)] = torch.from_numpy(array)
        host[len(array) :] = pad_value
        device = self._device[name][:num_rows]
        device.copy_(host, non_blocking=True)
        return device

    def device_view(self, name: str, num_rows: int) -> torch.Tensor:
        """The first rows of a device buffer, as a captured graph reads them."""
        return self._device[name][:num_rows]
