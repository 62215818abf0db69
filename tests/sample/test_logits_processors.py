"""Logits processors against per-row loops written from their definitions, on random batches."""

from __future__ import annotations

import random

import pytest
import torch

from pagedllm.sample.logits_processors import apply_allowed_token_ids, apply_bad_words, apply_logit_bias

VOCAB = 50


def _random_rows(num_rows: int, seed: int) -> tuple[torch.Tensor, random.Random]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn((num_rows, VOCAB), generator=generator), random.Random(seed)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("num_rows", [1, 3, 8])
def test_allowed_token_ids_keeps_only_those(num_rows, seed):
    logits, rng = _random_rows(num_rows, seed)
    allowed = [
        None if rng.random() < 0.3 else rng.sample(range(VOCAB), rng.randint(1, VOCAB))
        for _ in range(num_rows)
    ]
    out = logits.clone()
    apply_allowed_token_ids(out, allowed)
    for row in range(num_rows):
        for token in range(VOCAB):
            kept = allowed[row] is None or token in allowed[row]
            assert out[row, token].item() == (logits[row, token].item() if kept else float("-inf"))


@pytest.mark.parametrize("seed", range(5))
def test_logit_bias_adds_to_each_rows_tokens(seed):
    logits, rng = _random_rows(4, seed)
    biases = [
        None if rng.random() < 0.3 else {rng.randrange(VOCAB): rng.uniform(-100, 100) for _ in range(5)}
        for _ in range(4)
    ]
    out = logits.clone()
    apply_logit_bias(out, biases)
    expected = logits.clone()
    for row, bias in enumerate(biases):
        for token, value in (bias or {}).items():
            expected[row, token] += value
    torch.testing.assert_close(out, expected)


def test_bad_words_single_token_banned_everywhere_multi_token_after_prefix():
    logits = torch.zeros((3, VOCAB))
    words = [[[7], [3, 4, 5]], [[3, 4, 5]], None]
    past = [[1, 2], [9, 3, 4], [3, 4]]
    apply_bad_words(logits, words, past)
    # Row 0: 7 banned always; 5 not (its past does not end in 3, 4).
    assert logits[0, 7] == float("-inf") and logits[0, 5] == 0
    # Row 1: the past ends in the word's prefix: its last token is banned.
    assert logits[1, 5] == float("-inf") and (logits[1] == float("-inf")).sum() == 1
    # Row 2: no bad words.
    assert torch.all(logits[2] == 0)


def test_bad_words_prefix_longer_than_past_is_not_matched():
    logits = torch.zeros((1, VOCAB))
    apply_bad_words(logits, [[[1, 2, 3]]], [[2]])
    assert torch.all(logits == 0)


def test_no_parameters_leave_logits_untouched():
    logits, _ = _random_rows(2, 0)
    out = logits.clone()
    apply_allowed_token_ids(out, [None, None])
    apply_logit_bias(out, [None, {}])
    apply_bad_words(out, [None, []], [[], []])
    assert torch.equal(out, logits)
