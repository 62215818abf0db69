"""Prompt lookup (vLLM's ``ngram`` method) on the device, the worker's side: with asynchronous
scheduling the next step is scheduled before this one's tokens reach the host, so an n-gram draft
looked up on the host (core/spec_decode.py: ``NgramProposer``) would make every step wait for the
one before it. Here the lookup runs on the device after the step's samples, in the request's
tokens as the device has them, and its drafts travel like a draft model's (the scheduler schedules
placeholders; ``DeviceDrafts`` resolves them in the next step's inputs).

**The tokens.** ``token_ids`` [rows, max_model_len] holds each batch row's tokens by position. A
request's known tokens are copied in when its row gets them from the host (admission, or a
resumption after preemption: a new ``host_token_ids`` array); every step writes its input tokens
at their positions (prompt chunks, decode inputs, and the drafts being verified, so accepted
drafts are in place); a proposal writes the newest sample at its position first. A rejected
draft's position holds a stale token past the request's end until a later step writes it: the
lookup reads positions up to the newest only.

**The lookup**, per proposing request with newest token at position n (tokens h[0..n]): for every
earlier position e < n, the length of the common suffix of h[..e] and h[..n], capped at
``prompt_lookup_max``; the longest one of at least ``prompt_lookup_min`` wins, the latest among
equals (the host's rule). Its drafts are the tokens after e; where they run past n (the period
p = n - e is shorter than k) they continue periodically, ``h[e + 1 + (i mod p)]``: the
continuation the match predicts, where the host version stops at n. With no match the drafts
repeat the newest token. Any draft is lossless (a point-mass draft: the rejection sampler accepts
what the target would have produced); a poor one costs the verification a few rows.

Costs per step: [R, prompt_lookup_max, L] int comparisons for R proposing requests whose longest
holds L tokens: on a GPU one Triton launch (kernels/triton/ngram_lookup.py), elsewhere the torch
form, about twenty small launches over the rows' tokens up to L (bounded on the host).
"""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.config import EngineConfig
from pagedllm.platform import platform_for
from pagedllm.worker.draft_model import NewestPositions, unpadded_inputs
from pagedllm.worker.input_batch import InputBatch
from pagedllm.worker.input_buffers import to_device
from pagedllm.worker.step_inputs import ModelInput


def ngram_drafts(
    token_ids: torch.Tensor, newest: torch.Tensor, num_drafts: int, min_n: int, max_n: int
) -> torch.Tensor:
    """[R, num_drafts] drafts (``token_ids``' dtype) for R requests whose tokens are the rows of
    ``token_ids`` ([R, L]) up to position ``newest`` ([R] int64, < L), by the rule in the module
    docstring."""
    num_reqs, length = token_ids.shape
    device = token_ids.device
    positions = torch.arange(length, device=device)
    reqs = torch.arange(num_reqs, device=device)[:, None]
    # suffix[r, j]: the token j places before the newest (-1 before the start: matches nothing).
    back = newest[:, None] - torch.arange(max_n, device=device)
    suffix = torch.where(back >= 0, token_ids[reqs, back.clamp(min=0)], -1)
    # equal[r, j, e]: token e - j equals suffix[r, j] (False where e - j < 0).
    equal = torch.zeros((num_reqs, max_n, length), dtype=torch.bool, device=device)
    for j in range(min(max_n, length)):  # a shift past the table's length matches nothing
        equal[:, j, j:] = token_ids[:, : length - j] == suffix[:, j : j + 1]
    # A match's length: the run of equal tokens from j = 0; ends at or past the newest excluded.
    match_len = equal.to(torch.int32).cumprod(dim=1).sum(dim=1)
    match_len = torch.where(positions[None] < newest[:, None], match_len, 0)
    # The longest, latest among equals: one argmax over length * L + e.
    best = (match_len.to(torch.int64) * length + positions[None]).argmax(dim=1)
    best_len = match_len[reqs[:, 0], best]
    found = best_len >= min_n
    end = torch.where(found, best, newest - 1)  # no match: period 1 from the newest token
    period = (newest - end)[:, None]
    draft_pos = end[:, None] + 1 + torch.arange(num_drafts, device=device)[None] % period
    return token_ids[reqs, draft_pos]


class NgramDrafter:
    """The worker's n-gram drafter (``speculative_config.method == "ngram"`` with asynchronous
    scheduling), with the model runner's drafter interface (``DraftModelRunner``'s): no model,
    no cache, no graphs.

    Args:
        config: the engine's configuration (``speculative_config`` set).
        input_batch: the target runner's persistent batch (rows, host tokens, newest samples).
    """

    model = None  # no weights: nothing to load or prepack
    ready = True
    # A lookup leaves nothing behind (``prefill`` records the tokens): a step whose batch the
    # scheduler does not draft for (``SchedulerOutput.drafting``) skips it.
    proposes_statelessly = True
    block_bytes = 0
    scratch_bytes = 0

    def __init__(self, config: EngineConfig, input_batch: InputBatch) -> None:
        spec_config = config.speculative_config
        assert spec_config is not None
        self.num_speculative_tokens = spec_config.num_speculative_tokens
        self.min_n, self.max_n = spec_config.prompt_lookup_min, spec_config.prompt_lookup_max
        self.batch = input_batch
        self.device = config.device_config.device
        # Room for a request's tokens and, past its last one, the k drafts a verification writes.
        self.max_len = config.model_config.max_model_len + self.num_speculative_tokens
        # int32: a serving engine's rows times max_model_len add up (512 x 128k: 256 MiB).
        self.token_ids = torch.zeros(
            (input_batch.max_num_rows, self.max_len), dtype=torch.int32, device=self.device
        )
        # Per row, the host tokens last copied in (compared by identity: a new array is new tokens).
        self._copied: list[np.ndarray | None] = [None] * input_batch.max_num_rows
        # The lookup: one Triton launch where Triton runs (kernels/triton/ngram_lookup.py), else
        # the torch form over the proposing rows' tokens.
        self._lookup_kernel = None
        if platform_for(self.device).triton:
            from pagedllm.kernels.triton.ngram_lookup import ngram_lookup

            self._lookup_kernel = ngram_lookup

    def load_model(self, target: object) -> None:
        pass

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        pass

    def run_cache_ops(self, *block_moves: list[tuple[int, int]]) -> None:
        pass

    def capture_graphs(self, capture_sizes: list[int], target_graphs: object) -> None:
        pass

    def prefill(self, model_input: ModelInput, hidden_states: torch.Tensor) -> None:
        """Record the step's tokens: those rows received from the host, then the step's inputs."""
        assert model_input.req_rows is not None and model_input.req_query_start_loc is not None
        rows = model_input.req_rows
        self._copy_host_tokens(rows)
        input_ids, positions, _ = unpadded_inputs(model_input)
        token_rows = np.repeat(rows, np.diff(model_input.req_query_start_loc))
        self.token_ids[to_device(token_rows, self.device), positions] = input_ids.to(torch.int32)

    def _copy_host_tokens(self, rows: np.ndarray) -> None:
        host_tokens, copied = self.batch.host_token_ids, self._copied
        fresh = [row for row in rows.tolist() if copied[row] is not host_tokens[row]]
        if not fresh:
            return
        arrays = [host_tokens[row] for row in fresh]
        for row, tokens in zip(fresh, arrays):
            copied[row] = tokens
        lengths = [len(tokens) for tokens in arrays]
        index_rows = to_device(np.repeat(np.asarray(fresh, dtype=np.int64), lengths), self.device)
        index_pos = to_device(np.concatenate([np.arange(n, dtype=np.int64) for n in lengths]), self.device)
        tokens = to_device(np.concatenate(arrays).astype(np.int32), self.device)
        self.token_ids[index_rows, index_pos] = tokens

    def propose(self, rows: np.ndarray, newest: NewestPositions) -> tuple[np.ndarray, torch.Tensor]:
        """``k`` drafts for the requests in batch ``rows``, whose newest tokens
        (``last_token_ids``) sit at ``newest``. Returns the rows and [num_rows, k] int64 drafts."""
        if not len(rows):
            return rows, torch.empty((0, self.num_speculative_tokens), dtype=torch.int64, device=self.device)
        index = to_device(rows, self.device)
        position = newest.on_device(self.device)
        self.token_ids[index, position] = self.batch.last_token_ids.index_select(0, index).to(torch.int32)
        k, min_n, max_n = self.num_speculative_tokens, self.min_n, self.max_n
        if self._lookup_kernel is not None:
            return rows, self._lookup_kernel(self.token_ids, index, position, k, min_n, max_n).to(torch.int64)
        # The longest row's tokens, bounded on the host (a verification's count adds at most k).
        slack = 0 if newest.accepted is None else k
        length = min(int(newest.host.max()) + 1 + slack, self.max_len)
        tokens = self.token_ids.index_select(0, index)[:, :length]
        return rows, ngram_drafts(tokens, position, k, min_n, max_n).to(torch.int64)
