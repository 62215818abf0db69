"""The Triton kernels' context-parallel attention: ``forward_partial`` over one rank's stripe of the
KV cache, against a naive float64 reference, and the ranks' partials merged by log-sum-exp against
the unsplit ``forward``.

Runs on the CPU under TRITON_INTERPRET=1 (conftest.py), else on CUDA. Launches are shrunk
(``tiny_launches``) so that tiny contexts still span several decode partitions, prefill query
tiles and key tiles on every rank.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the triton attention backend needs the triton package")

from pagedllm.attention.backends import triton_backend
from pagedllm.attention.backends.cuda_backend import CudaAttentionBackend
from pagedllm.attention.backends.torch_backend import TorchAttentionBackend
from pagedllm.attention.backends.triton_backend import TritonAttentionBackend
from tests.kernels import cp_attention_inputs as cp

if not cp.INTERPRET and not torch.cuda.is_available():
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)
DEVICE = cp.DEVICE

# (atol, rtol), as the Triton kernel tests use: float32 dots are exact; float16 rounds q and p.
TOLERANCES = {torch.float32: (1e-4, 1e-4), torch.float16: (4e-3, 4e-3)}
NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE = 4, 2, 64
SHAPE = (NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE)
SCALE = HEAD_SIZE**-0.5


@pytest.fixture(autouse=True)
def tiny_launches(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode partitions of 32 keys in tiles of 16, prefill tiles of 16 x 16."""
    decode = {"partition_size": 32, "block_n": 16, "num_warps": 4, "num_stages": 2}
    prefill = {"block_m": 16, "block_n": 16, "num_warps": 4, "num_stages": 2}
    monkeypatch.setattr(triton_backend, "_launch_kwargs", lambda head_size, dtype: (decode, prefill))


def backend(
    cp_rank: int = 0, cp_world_size: int = 1, kv_scales: tuple[float, float] | None = None, **variants: object
) -> TritonAttentionBackend:
    """A layer of rank cp_rank of cp_world_size; kv_scales: an FP8 cache's (k_scale, v_scale)."""
    variants = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in variants.items()}
    layer = TritonAttentionBackend(
        NUM_HEADS, HEAD_SIZE, SCALE, NUM_KV_HEADS, cp_rank=cp_rank, cp_world_size=cp_world_size, **variants
    )
    if kv_scales is not None:
        layer.k_scale, layer.v_scale = (torch.tensor(x, device=DEVICE) for x in kv_scales)
    return layer


def run_partial(
    seqs: cp.Sequences,
    layer: TritonAttentionBackend,
    block_size: int,
    dtype: torch.dtype,
    cache_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """forward_partial of ``layer`` on its rank's step (two padding tokens after the real ones),
    cut to the real tokens."""
    step = cp.rank_step(
        seqs, layer.cp_rank, layer.cp_world_size, block_size, dtype, DEVICE, 2, cache_dtype=cache_dtype
    )
    out, lse = layer.forward_partial(step.query, step.key, step.value, step.kv_cache, step.md)
    assert out.dtype == dtype and out.shape == step.query.shape
    assert lse.dtype == torch.float32 and lse.shape == step.query.shape[:2]
    num_tokens = seqs.query.shape[0]
    return out[:num_tokens], lse[:num_tokens]


def assert_partial_matches(
    got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor], dtype: torch.dtype
) -> None:
    (out, lse), (ref_out, ref_lse) = got, want
    atol, rtol = TOLERANCES[dtype]
    assert not out.isnan().any() and not lse.isnan().any(), "NaN in out or lse (a row never written?)"
    # -inf exactly where the reference sees no key; out 0 there.
    assert torch.equal(lse.isneginf().cpu(), ref_lse.isneginf()), (
        "lse -inf where a row sees no key, only there"
    )
    torch.testing.assert_close(out.double().cpu(), ref_out, atol=atol, rtol=rtol)
    seen = ~ref_lse.isneginf()
    torch.testing.assert_close(lse.double().cpu()[seen], ref_lse[seen], atol=atol, rtol=rtol)


def slopes() -> torch.Tensor:
    return torch.tensor([0.5, 0.25, 0.125, 0.0625])


VARIANTS = {
    "plain": {},
    "window1": {"sliding_window": 1},
    "window7": {"sliding_window": 7},
    "window40": {"sliding_window": 40},
    "alibi": {"alibi_slopes": slopes()},
    "softcap": {"logits_soft_cap": 2.0},
    "window-alibi-softcap": {"sliding_window": 23, "alibi_slopes": slopes(), "logits_soft_cap": 5.0},
}
# Four decodes (position 0, a context inside one partition on every rank, several partitions),
# then prefill chunks: a fresh prompt over several query tiles, chunks after a cached prefix, a
# one-token chunk.
MIXED = (4, [0, 9, 70, 131], [1] * 4)
PREFILLS = ([0, 45, 21, 90], [37, 16, 1, 5])


def mixed_sequences(seed: int = 0) -> cp.Sequences:
    num_decodes, decode_ctx, decode_q = MIXED
    context_lens, query_lens = decode_ctx + PREFILLS[0], decode_q + PREFILLS[1]
    return cp.make_sequences(num_decodes, context_lens, query_lens, SHAPE, seed)


# Each variant over one block size (the plain one over both): the interpreter is slow.
VARIANT_BLOCKS = [
    ("plain", 8),
    ("plain", 16),
    ("window1", 8),
    ("window7", 16),
    ("window40", 8),
    ("alibi", 16),
    ("softcap", 8),
    ("window-alibi-softcap", 16),
]


# Three ranks (a stripe that is not a power of two) run in `make test-slow`: interpreted, each case
# takes seconds, and two ranks exercise every path of the kernels already.
THREE_RANKS = pytest.param(3, marks=pytest.mark.slow)


@pytest.mark.parametrize("variant, block_size", VARIANT_BLOCKS)
@pytest.mark.parametrize("cp_world_size", [2, THREE_RANKS])
def test_forward_partial_matches_reference(variant: str, block_size: int, cp_world_size: int) -> None:
    seqs = mixed_sequences()
    variants = VARIANTS[variant]
    for cp_rank in range(cp_world_size):
        got = run_partial(seqs, backend(cp_rank, cp_world_size, **variants), block_size, torch.float32)
        want = cp.reference_partial(seqs, (cp_rank, cp_world_size), SCALE, **variants)
        assert_partial_matches(got, want, torch.float32)


@pytest.mark.parametrize("cp_world_size", [2, 3])
def test_forward_partial_float16_matches_reference(cp_world_size: int) -> None:
    seqs = mixed_sequences(seed=1)
    for cp_rank in range(cp_world_size):
        got = run_partial(seqs, backend(cp_rank, cp_world_size), 16, torch.float16)
        want = cp.reference_partial(seqs.rounded(torch.float16), (cp_rank, cp_world_size), SCALE)
        assert_partial_matches(got, want, torch.float16)


def test_queries_without_a_key_on_the_rank_give_minus_inf_and_zero() -> None:
    # Position 0 (a decode of a one-token context, and a fresh prompt's first token) is rank 0's:
    # on ranks 1 and 2 those rows see nothing. So does every row of rank 2 before position 2.
    seqs = cp.make_sequences(1, [0, 0], [1, 3], SHAPE)
    for cp_rank in (1, 2):
        out, lse = run_partial(seqs, backend(cp_rank, 3), 8, torch.float32)
        no_key = [0, 1] if cp_rank == 1 else [0, 1, 2]  # token rows: the decode, then the prompt
        assert lse[no_key].isneginf().all() and (out[no_key] == 0).all()
        assert lse[3].isfinite().all()


def test_partial_without_context_parallelism_is_forward_with_lse() -> None:
    seqs = mixed_sequences(seed=2)
    got = run_partial(seqs, backend(sliding_window=40), 16, torch.float32)
    assert_partial_matches(got, cp.reference_partial(seqs, (0, 1), SCALE, sliding_window=40), torch.float32)


def merged_against_unsplit(
    seqs: cp.Sequences, cp_world_size: int, block_size: int, cache_dtype: torch.dtype, **options: object
) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor, torch.Tensor]:
    """((merged out, merged lse) of the P ranks' partials, forward's out on the unsplit cache, the
    unsplit forward_partial's lse), float32 queries over caches of cache_dtype. options: backend's."""
    partials = [
        run_partial(seqs, backend(r, cp_world_size, **options), block_size, torch.float32, cache_dtype)
        for r in range(cp_world_size)
    ]
    merged = cp.merge_partials([o for o, _ in partials], [lse for _, lse in partials])
    step = cp.rank_step(seqs, 0, 1, block_size, torch.float32, DEVICE, cache_dtype=cache_dtype)
    unsplit = backend(**options).forward(step.query, step.key, step.value, step.kv_cache, step.md)
    _, unsplit_lse = run_partial(seqs, backend(**options), block_size, torch.float32, cache_dtype)
    return merged, unsplit, unsplit_lse


@pytest.mark.parametrize("variant", ["plain", "window7", "window-alibi-softcap"])
@pytest.mark.parametrize("cp_world_size", [2, THREE_RANKS])
def test_merged_partials_equal_unsplit_forward(variant: str, cp_world_size: int) -> None:
    seqs = mixed_sequences(seed=3)
    (out, lse), unsplit, unsplit_lse = merged_against_unsplit(
        seqs, cp_world_size, 8, torch.float32, **VARIANTS[variant]
    )
    atol, rtol = TOLERANCES[torch.float32]
    torch.testing.assert_close(out.float(), unsplit.float(), atol=atol, rtol=rtol)
    torch.testing.assert_close(lse.float(), unsplit_lse, atol=atol, rtol=rtol)
    # And the unsplit step against the torch backend, an oracle the Triton kernels do not share.
    step = cp.rank_step(seqs, 0, 1, 8, torch.float32, DEVICE)
    torch_caches = tuple(c.permute(0, 2, 1, 3).contiguous() for c in step.kv_cache)
    variants = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in VARIANTS[variant].items()}
    oracle = TorchAttentionBackend(NUM_HEADS, HEAD_SIZE, SCALE, NUM_KV_HEADS, **variants)
    want = oracle.forward(step.query, step.key, step.value, torch_caches, step.md)
    num_tokens = seqs.query.shape[0]
    torch.testing.assert_close(out.float(), want[:num_tokens].float(), atol=atol, rtol=rtol)


def test_merged_partials_over_an_fp8_cache_equal_unsplit_forward() -> None:
    seqs = mixed_sequences(seed=4)
    (out, lse), unsplit, unsplit_lse = merged_against_unsplit(
        seqs, 2, 16, torch.float8_e4m3fn, kv_scales=(0.02, 0.05), sliding_window=40
    )
    torch.testing.assert_close(out.float(), unsplit.float(), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lse.float(), unsplit_lse, atol=1e-4, rtol=1e-4)


def test_forward_partial_is_refused_without_context_parallel_support() -> None:
    assert TritonAttentionBackend.supports_context_parallel
    assert not CudaAttentionBackend.supports_context_parallel
    layer = CudaAttentionBackend(NUM_HEADS, HEAD_SIZE, SCALE, NUM_KV_HEADS, cp_rank=1, cp_world_size=2)
    step = cp.rank_step(mixed_sequences(), 1, 2, 8, torch.float32, DEVICE)
    with pytest.raises(NotImplementedError, match=r"the 'cuda' attention backend does not read a striped"):
        layer.forward_partial(step.query, step.key, step.value, step.kv_cache, step.md)
