"""The layout of one step's flattened batch, as every attention backend reads it."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Where each sequence's new tokens sit in the flattened batch, and where its K/V live.

    The batch holds ``num_seqs`` sequences; their new tokens are concatenated (CSR layout, as in
    the flattened batch of continuous batching). Sequences with a single new token (decodes) come first::

        tokens      [ d0 | d1 | d2 | p0 p0 p0 p0 | p1 p1 ]     num_decodes = 3, num_prefills = 2
        query_start_loc = [0, 1, 2, 3, 7, 9]

    Sequence ``i``'s queries are the last ``query_len_i`` positions of a context of
    ``seq_lens[i]`` tokens: it attends to its cached tokens and causally to its own new ones.
    """

    # Sequences [0, num_decodes) have exactly one new token each.
    num_decodes: int
    # Sequences [num_decodes, num_seqs) have one or more (prefill chunks).
    num_prefills: int
    # [num_tokens] int64: cache slot written by each new token, -1 for padding (not written).
    slot_mapping: torch.Tensor
    # [num_seqs + 1] int32: offsets of each sequence's tokens in the batch.
    query_start_loc: torch.Tensor
    # [num_seqs] int32: tokens in each sequence's context after this step (cached + new).
    seq_lens: torch.Tensor
    # [num_seqs, max_num_blocks_per_seq] int32: physical block numbers, padded with 0.
    block_tables: torch.Tensor
    # The largest query length and context length in the batch (host ints, for grid sizes).
    max_query_len: int
    max_seq_len: int
    # Host copies of query_start_loc and seq_lens, for backends that plan on the host.
    query_start_loc_cpu: torch.Tensor
    seq_lens_cpu: torch.Tensor
    # The shortest decode context (host int), for launches that size work by the spread of
    # lengths; 0 where unknown (a captured CUDA graph serves every length).
    min_decode_seq_len: int = 0
    # [num_seqs] int64: each sequence's row of the recurrent-state cache (hybrid models'
    # linear-attention layers; -1, the scratch row, for padding); None for other models.
    state_slots: torch.Tensor | None = None
    # Query groups of verified drafts, a hint a backend may take (paged_decode's query_lens):
    # [num_decodes] int32, at the last of each request's consecutive decodes (a verification
    # expanded into one decode per token) how many they are, 0 at the others, 1 at a lone decode;
    # None where verifications are not expanded. max_decode_query_len (a host int, the engine's
    # num_speculative_tokens + 1) bounds them: the kernels' rows, fixed for a captured graph.
    decode_query_lens: torch.Tensor | None = None
    max_decode_query_len: int = 1

    @property
    def num_seqs(self) -> int:
        return self.num_decodes + self.num_prefills
