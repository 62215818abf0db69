"""Context parallelism: attention over a KV cache striped by token across ranks, merged exactly.

``context_parallel_size`` P ranks share every sequence's cache: rank r holds the tokens at
positions ``t % P == r`` (``worker/step_inputs.compute_slot_mapping``), so a long context takes
1/P of each rank's memory and each rank reads 1/P of it per step. The hidden states are the
same on every rank of the group (each holds the same weights, or the same tensor-parallel
shard), so every rank has every query of the step. Each attends all of them to the keys it
holds (``AttentionBackend.forward_partial``), striped so that the causal triangle's work is
even across ranks whatever the prompt length (Striped Attention, Brandon et al. 2023), and the
partials are merged by their log-sum-exps, the online softmax's rule (Milakov & Gimelshein 2018;
Ring Attention, Liu et al. 2023; the tree reduction of Tree Attention, Shyam et al. 2024)::

    out = sum_r exp(lse_r - m) out_r / sum_r exp(lse_r - m),    m = max_r lse_r

Every rank gathers every partial and merges them in the same order, so all of them hold the
same bits afterwards and go on identically. One all-gather a layer, of
``num_tokens x num_heads x (head_size + 1)`` float32 values per rank.
"""

from __future__ import annotations

import torch

from pagedllm.distributed import context_parallel_all_gather


def merge_partials(outs: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:
    """outs: [P, num_tokens, num_heads, head_size]; lses: [P, num_tokens, num_heads], -inf where
    a rank saw no key -> the merged attention [num_tokens, num_heads, head_size] in float32. Every
    query sees at least its own token, on the rank that holds it: the max is finite."""
    top = lses.max(dim=0).values
    weights = torch.exp(lses - top)
    merged = (weights[..., None] * outs.float()).sum(dim=0)
    return merged / weights.sum(dim=0)[..., None]


def merge_across_ranks(out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """This rank's partial (``forward_partial``'s out and lse) merged with the other
    context-parallel ranks': the attention over every rank's keys, in out's dtype."""
    head_size = out.shape[-1]
    packed = torch.cat((out.float(), lse[..., None]), dim=-1)  # one collective for both
    gathered = context_parallel_all_gather(packed)
    return merge_partials(gathered[..., :head_size], gathered[..., head_size]).to(out.dtype)
