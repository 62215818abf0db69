"""Per-request logits processors: allowed tokens, bad words, logit bias (vLLM's names).

Each is a pure function over a step's logits ``[num_rows, vocab_size]`` (one row per sequence
being sampled) and per-row parameters (None: the row is untouched). Each edits the logits in
place with one scatter/index_put per batch, so the cost does not grow with Python loops over
the vocabulary; only bad words of several tokens look at each row's past tokens on the host.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def apply_allowed_token_ids(logits: torch.Tensor, allowed_token_ids: Sequence[Sequence[int] | None]) -> None:
    """Set every logit outside a row's ``allowed_token_ids`` to -inf.

    Args:
        logits: [num_rows, vocab_size], edited in place.
        allowed_token_ids: per row, the token ids it may sample, or None for all.
    """
    rows = [i for i, allowed in enumerate(allowed_token_ids) if allowed is not None]
    if not rows:
        return
    keep = torch.zeros((len(rows), logits.shape[1]), dtype=torch.bool)
    row_index, token_index = _row_token_indices([allowed_token_ids[i] for i in rows])
    keep[row_index, token_index] = True
    rows_t = torch.tensor(rows, dtype=torch.long, device=logits.device)
    logits[rows_t] = logits[rows_t].masked_fill(~keep.to(logits.device), float("-inf"))


def apply_logit_bias(logits: torch.Tensor, logit_bias: Sequence[dict[int, float] | None]) -> None:
    """Add each row's ``{token_id: bias}`` to its logits.

    Args:
        logits: [num_rows, vocab_size], edited in place.
        logit_bias: per row, token id -> bias, or None.
    """
    row_index, token_index, values = [], [], []
    for row, bias in enumerate(logit_bias):
        for token_id, value in (bias or {}).items():
            row_index.append(row)
            token_index.append(token_id)
            values.append(value)
    if not values:
        return
    index = (
        torch.tensor(row_index, dtype=torch.long, device=logits.device),
        torch.tensor(token_index, dtype=torch.long, device=logits.device),
    )
    logits.index_put_(index, torch.tensor(values, dtype=logits.dtype, device=logits.device), accumulate=True)


def apply_bad_words(
    logits: torch.Tensor,
    bad_words_token_ids: Sequence[Sequence[Sequence[int]] | None],
    past_token_ids: Sequence[Sequence[int]],
) -> None:
    """Ban the token that would complete a bad word (as vLLM does).

    A one-token bad word is banned everywhere; a word of k tokens has its last token banned when
    the row's last k-1 generated tokens are its first k-1.

    Args:
        logits: [num_rows, vocab_size], edited in place.
        bad_words_token_ids: per row, its bad words as token-id sequences, or None.
        past_token_ids: per row, the tokens it has generated so far.
    """
    row_index, token_index = [], []
    for row, words in enumerate(bad_words_token_ids):
        past = past_token_ids[row]
        for word in words or ():
            prefix = list(word[:-1])
            if not prefix or (len(past) >= len(prefix) and list(past[-len(prefix) :]) == prefix):
                row_index.append(row)
                token_index.append(word[-1])
    if row_index:
        logits[
            torch.tensor(row_index, dtype=torch.long, device=logits.device),
            torch.tensor(token_index, dtype=torch.long, device=logits.device),
        ] = float("-inf")


def _row_token_indices(token_ids: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    # (row, token) pairs for index_put: rows repeated by their number of tokens.
    lengths = torch.tensor([len(ids) for ids in token_ids], dtype=torch.long)
    rows = torch.repeat_interleave(torch.arange(len(token_ids)), lengths)
    tokens = torch.tensor([t for ids in token_ids for t in ids], dtype=torch.long)
    return rows, tokens
