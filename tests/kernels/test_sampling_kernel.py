"""The sampler's fused last pass (kernels/triton/sampling.py) against the sampler's torch path:
the same tokens (the first maximum on ties) and the same logprobs, for greedy and sampled rows,
ties, banned tokens, vocabularies of one element to many chunks, and noise given per row.

Runs on the CPU under TRITON_INTERPRET=1 (set by conftest.py when there is no GPU), else on CUDA.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton", reason="the fused sampling kernel needs the triton package")

from pagedllm.kernels.triton.sampling import apply_token_bitmask, logsumexp, sample_tokens
from pagedllm.sample.sampler import _race

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)
DEVICE = torch.device("cpu" if INTERPRET else "cuda")


def _reference(raw, x, noise, inv_temperature, greedy):
    tokens = _race(x, noise, inv_temperature, greedy)
    return tokens, torch.log_softmax(raw, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)


def _check(raw, x, noise=None, inv_temperature=None, greedy=None):
    tokens, logprobs = sample_tokens(raw, x, noise, inv_temperature, greedy)
    expected_tokens, expected_logprobs = _reference(raw, x, noise, inv_temperature, greedy)
    # Sampled rows compute x / T - log q on both sides, where rounding may differ in the last
    # bit: where the reference's best two scores are that close, either of them is right.
    scores = (
        x if noise is None else torch.where(greedy[:, None], x, x * inv_temperature[:, None] - noise.log())
    )
    for row in range(raw.shape[0]):
        token, expected = int(tokens[row]), int(expected_tokens[row])
        if token != expected:
            assert greedy is not None and not greedy[row], f"row {row}: greedy rows must agree exactly"
            assert scores[row, token] >= scores[row, expected] - 1e-5 * scores[row, expected].abs()
    torch.testing.assert_close(logprobs, raw.log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1))
    torch.testing.assert_close(
        logprobs[tokens == expected_tokens], expected_logprobs[tokens == expected_tokens]
    )
    assert tokens.dtype == torch.int64 and logprobs.dtype == torch.float32


@pytest.mark.parametrize("num_rows", [1, 3, 40])
@pytest.mark.parametrize("vocab_size", [1, 7, 1024, 1025, 5000])
def test_greedy_rows_take_the_first_maximum_and_its_logprob(num_rows, vocab_size):
    generator = torch.Generator().manual_seed(num_rows * 10_000 + vocab_size)
    # Integer logits: many exact ties, where torch.argmax takes the first.
    raw = torch.randint(-3, 4, (num_rows, vocab_size), generator=generator).float().to(DEVICE)
    _check(raw, raw)
    # Penalised or banned logits differ from the raw ones the logprobs come from.
    x = raw.clone()
    x[:, : vocab_size // 2] = float("-inf")
    _check(raw, x)


@pytest.mark.parametrize("num_rows, vocab_size", [(1, 1000), (5, 3000), (33, 4097), (2, 50_000)])
def test_sampled_and_greedy_rows_mixed(num_rows, vocab_size):
    generator = torch.Generator().manual_seed(num_rows + vocab_size)
    raw = (4 * torch.randn((num_rows, vocab_size), generator=generator)).to(DEVICE)
    noise = torch.empty((num_rows, vocab_size)).exponential_(generator=generator).to(DEVICE)
    inv_temperature = (0.2 + 2 * torch.rand(num_rows, generator=generator)).to(DEVICE)
    greedy = (torch.arange(num_rows) % 3 == 0).to(DEVICE)
    _check(raw, raw, noise, inv_temperature, greedy)
    x = raw.clone()
    x[:, ::5] = float("-inf")  # top-k / min-p truncation leaves -inf holes
    _check(raw, x, noise, inv_temperature, greedy)


def test_a_fully_banned_chunk_and_a_row_stride():
    # Rows of a wider buffer (the sampler's logits are a slice of the scored rows).
    wide = torch.randn((4, 3000), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    raw = wide[:, :2500]
    x = raw.clone()
    x[:, :2048] = float("-inf")  # two whole chunks of -inf
    _check(raw, x)
    greedy = torch.tensor([True, False, False, True], device=DEVICE)
    noise = torch.ones_like(raw)  # log q = 0: the sampled rows' argmax of x / T
    _check(raw, raw, noise, torch.full((4,), 0.5, device=DEVICE), greedy)


@pytest.mark.parametrize("vocab_size", [1, 31, 32, 33, 1000, 5000])
def test_apply_token_bitmask_bans_exactly_the_zero_bits(vocab_size):
    generator = torch.Generator().manual_seed(vocab_size)
    num_rows = 3
    words = torch.randint(
        -(2**31), 2**31, (num_rows, -(-vocab_size // 32)), generator=generator, dtype=torch.int64
    )
    bitmask = words.to(torch.int32)
    logits = torch.randn((num_rows, vocab_size), generator=generator)
    expected = logits.clone()
    for row in range(num_rows):
        for token in range(vocab_size):
            if not (int(bitmask[row, token // 32]) >> (token % 32)) & 1:
                expected[row, token] = float("-inf")
    # Rows of a wider buffer: the logits' row stride is not the vocabulary's.
    wide = torch.full((num_rows, vocab_size + 7), 5.0)
    wide[:, :vocab_size] = logits
    out = wide.to(DEVICE)[:, :vocab_size]
    apply_token_bitmask(out, bitmask.to(DEVICE))
    assert torch.equal(out.cpu(), expected)


# On CUDA the pass also reads a bitmask in pinned host memory, in place (the worker's buffers).
BITMASK_PLACES = ["device"] if INTERPRET else ["device", "pinned host"]


@pytest.mark.parametrize("place", BITMASK_PLACES)
@pytest.mark.parametrize("num_rows, vocab_size", [(1, 33), (3, 1025), (33, 5000)])
def test_a_bitmask_given_to_the_pass_equals_applying_it_first(num_rows, vocab_size, place):
    """The grammar bitmask read by the partials pass gives the tokens and logprobs of the pass
    over logits that ``apply_token_bitmask`` masked first, for greedy and sampled rows, logits
    already changed by penalties, rows whose every token but one is banned, and a row stride."""
    generator = torch.Generator().manual_seed(num_rows * 7 + vocab_size)
    wide = (3 * torch.randn((num_rows, vocab_size + 5), generator=generator)).to(DEVICE)
    raw = wide[:, :vocab_size]
    words = torch.randint(-(2**31), 2**31, (num_rows, -(-vocab_size // 32)), generator=generator)
    bitmask = words.to(torch.int32)
    bitmask[0] = 0
    bitmask[0, (vocab_size - 1) // 32] = 1 << ((vocab_size - 1) % 32)  # one token left
    read = bitmask.pin_memory() if place == "pinned host" else bitmask.to(DEVICE)
    bitmask = bitmask.to(DEVICE)
    noise = torch.empty((num_rows, vocab_size)).exponential_(generator=generator).to(DEVICE)
    inv_temperature = (0.5 + torch.rand(num_rows, generator=generator)).to(DEVICE)
    greedy = (torch.arange(num_rows) % 2 == 0).to(DEVICE)
    penalised = raw - 0.5
    for x, sampled in ((raw, False), (penalised, False), (raw, True), (penalised, True)):
        masked_raw, masked_x = raw.clone(), x.clone()
        apply_token_bitmask(masked_raw, bitmask)
        apply_token_bitmask(masked_x, bitmask)
        args = (noise, inv_temperature, greedy) if sampled else ()
        tokens, logprobs = sample_tokens(raw, x, *args, bitmask=read)
        expected_tokens, expected_logprobs = sample_tokens(
            masked_raw, masked_raw if x is raw else masked_x, *args
        )
        assert torch.equal(tokens, expected_tokens)
        torch.testing.assert_close(logprobs, expected_logprobs, atol=0, rtol=0)
        assert tokens[0].item() == vocab_size - 1 and torch.isfinite(logprobs).all()


@pytest.mark.parametrize("vocab_size", [1, 3000, 9000, 20_000])
def test_invariant_rows_are_the_same_bits_alone_and_in_any_batch(vocab_size):
    """``invariant=True``: a row's token, logprob and logsumexp do not depend on the other rows,
    in a batch of 40 (past the row count where the default chunk grows), with sampled and
    penalised neighbours and a bitmask, and its logprob is ``raw[token] - logsumexp(raw)`` to the
    bit, which the sampler's ``log_softmax`` (top tokens, prompt logprobs) reports. (One token
    far above a long tail: a logsumexp near 0, whose last bits show the tail's summation order;
    without ``invariant`` the rows of 9,000 and 20,000 tokens differ alone and in the batch.)"""
    generator = torch.Generator().manual_seed(vocab_size)
    num_rows = 40
    raw = -12 + 2 * torch.randn((num_rows, vocab_size), generator=generator)
    raw[:, vocab_size // 2] = 0.0
    raw = raw.to(DEVICE)
    noise = torch.empty((num_rows, vocab_size)).exponential_(generator=generator).to(DEVICE)
    inv_temperature = (0.5 + torch.rand(num_rows, generator=generator)).to(DEVICE)
    greedy = (torch.arange(num_rows) % 2 == 0).to(DEVICE)
    bitmask = torch.full((num_rows, -(-vocab_size // 32)), -1, dtype=torch.int32, device=DEVICE)
    batch_lse = logsumexp(raw, invariant=True)
    # A greedy row of the batch alone takes the all-greedy kernel, unpenalised and unmasked.
    tokens, logprobs = sample_tokens(raw, raw - 0.25, noise, inv_temperature, greedy, bitmask, invariant=True)
    for row in (0, 1, 17, num_rows - 1):
        one = slice(row, row + 1)
        alone_lse = logsumexp(raw[one].clone(), invariant=True)
        assert torch.equal(alone_lse, batch_lse[one])
        args = () if greedy[row] else (noise[one], inv_temperature[one], greedy[one])
        token, logprob = sample_tokens(raw[one].clone(), raw[one] - 0.25, *args, invariant=True)
        assert torch.equal(token, tokens[one]) and torch.equal(logprob, logprobs[one])
        assert torch.equal(logprob, raw[row, token] - alone_lse)
    torch.testing.assert_close(batch_lse, torch.logsumexp(raw, dim=-1))


def test_zero_noise_never_picks_a_banned_token():
    # q rounds to 0 now and then; a banned token (-inf) with q = 0 must still lose.
    raw = torch.randn((2, 3000), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    x = raw.clone()
    x[:, 100:200] = float("-inf")
    noise = torch.ones_like(raw)
    noise[:, 150] = 0.0
    greedy = torch.tensor([False, False], device=DEVICE)
    inv_temperature = torch.ones(2, device=DEVICE)
    tokens, _ = sample_tokens(raw, x, noise, inv_temperature, greedy)
    expected = _race(x, noise, inv_temperature, greedy)
    assert tokens.tolist() == expected.tolist()
    assert not ((tokens >= 100) & (tokens < 200)).any()


def test_every_pointer_is_aligned_whatever_the_row_count(monkeypatch):
    """Triton compiles a variant per pointer alignment (16 bytes or not): a buffer whose alignment
    followed the batch's row count compiled new variants seconds into serving. Every tensor the
    two kernels get starts on a 16-byte boundary, for any number of rows and any vocabulary."""
    import pagedllm.kernels.triton.sampling as sampling

    misaligned: list[tuple[str, int, int, int]] = []

    class Recorder:
        def __init__(self, name: str) -> None:
            self.name = name

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                for position, arg in enumerate(args):
                    if isinstance(arg, torch.Tensor) and arg.data_ptr() % 16:
                        misaligned.append((self.name, position, num_rows, vocab_size))

            return launch

    monkeypatch.setattr(sampling, "_partials_kernel", Recorder("partials"))
    monkeypatch.setattr(sampling, "_merge_kernel", Recorder("merge"))
    for vocab_size in (151_936, 49_152, 1_000, 7):
        for num_rows in range(1, 10):
            raw = torch.zeros((num_rows, vocab_size))
            noise = torch.ones_like(raw)
            greedy = torch.zeros(num_rows, dtype=torch.bool)
            sample_tokens(raw, raw, noise, torch.ones(num_rows), greedy)
    assert misaligned == []
