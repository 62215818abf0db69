"""The Triton MLA decode kernel (kernels/triton/mla_decode.py) against a float64 naive reference of
the absorbed form, and against the model's own ``MLAAttention._attend_absorbed`` (the torch path).

Runs on the CPU under TRITON_INTERPRET=1 (conftest.py), else on CUDA; float32 and tiny shapes
(kv_lora_rank 32, rope 8): contexts that cross partitions and blocks, ragged batches, heads not
a multiple of the kernel's block of 16. The block tables are shuffled and the cache outside the
sequences' slots is NaN, so a read of a wrong slot shows.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the MLA decode kernel needs the triton package")

from pagedllm.kernels.triton.mla_decode import check_mla_dims, mla_decode

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# DeepSeek-V2-Lite has r = 512, rope 64; 8 rope dims exercise the padding to a dot's depth.
RANK, ROPE = 32, 8


def _batch(seq_lens: list[int], num_heads: int, block_size: int, seed: int = 0) -> dict:
    """A paged latent cache holding each sequence's context in shuffled blocks, NaN elsewhere."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    order = torch.randperm(num_blocks, generator=gen)
    cache = torch.full((num_blocks, block_size, RANK + ROPE), float("nan"))
    block_tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
    contexts, next_block = [], 0
    for i, (seq_len, n) in enumerate(zip(seq_lens, blocks_per_seq)):
        blocks = order[next_block : next_block + n]
        next_block += n
        block_tables[i, :n] = blocks
        context = torch.randn(seq_len, RANK + ROPE, generator=gen)
        cache.view(-1, RANK + ROPE)[
            (blocks[:, None] * block_size + torch.arange(block_size)).flatten()[:seq_len]
        ] = context
        contexts.append(context)
    return {
        "q_latent": torch.randn(len(seq_lens), num_heads, RANK, generator=gen),
        "q_pe": torch.randn(len(seq_lens), num_heads, ROPE, generator=gen),
        "cache": cache,
        "block_tables": block_tables,
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32),
        "contexts": contexts,
    }


def _naive(q_latent: torch.Tensor, q_pe: torch.Tensor, context: torch.Tensor, scale: float) -> torch.Tensor:
    """One sequence, float64: softmax over [q_latent | q_pe] . [c | k_pe], weights times c."""
    query = torch.cat((q_latent, q_pe), dim=-1).double()  # [heads, r + rope]
    probs = torch.softmax(query @ context.double().T * scale, dim=-1)
    return probs @ context[:, :RANK].double()


def _run(batch: dict, scale: float, max_seq_len: int, **launch: int) -> torch.Tensor:
    out = torch.empty_like(batch["q_latent"], device=DEVICE)
    tensors = {k: batch[k].to(DEVICE) for k in ("q_latent", "q_pe", "cache", "block_tables", "seq_lens")}
    mla_decode(**tensors, scale=scale, max_seq_len=max_seq_len, out=out, **launch)
    return out.cpu()


@pytest.mark.parametrize(
    ("seq_lens", "num_heads", "block_size", "partition_size"),
    [
        ([1], 16, 16, 32),  # one token, one head block
        ([5, 70, 33, 128], 20, 16, 32),  # ragged, several partitions, a second partial head block
        ([40, 3, 97], 7, 8, 64),  # fewer heads than a block; block 8, tiles straddle blocks
        ([65, 64], 16, 32, 128),  # one partition each: the direct write, no reduce
    ],
)
def test_mla_decode_matches_naive(
    seq_lens: list[int], num_heads: int, block_size: int, partition_size: int
) -> None:
    batch = _batch(seq_lens, num_heads, block_size)
    scale = 0.3
    out = _run(batch, scale, max(seq_lens) + 5, partition_size=partition_size)
    for i, context in enumerate(batch["contexts"]):
        expected = _naive(batch["q_latent"][i], batch["q_pe"][i], context, scale)
        torch.testing.assert_close(out[i].double(), expected, rtol=1e-4, atol=1e-4)


def test_mla_decode_matches_the_layers_absorbed_form() -> None:
    """The kernel fed W_UK^T q_nope is ``_attend_absorbed`` before W_UV (the torch path's math)."""
    from types import SimpleNamespace

    from pagedllm.models.deepseek_v2 import MLAAttention

    num_heads, nope, v_dim, seq_len = 3, 8, 12, 50
    gen = torch.Generator().manual_seed(1)
    layer = SimpleNamespace(
        kv_lora_rank=RANK,
        qk_nope_head_dim=nope,
        qk_rope_head_dim=ROPE,
        scale=0.25,
        w_uk=torch.randn(num_heads, nope, RANK, generator=gen),
        w_uv=torch.randn(num_heads, v_dim, RANK, generator=gen),
    )
    batch = _batch([seq_len], num_heads, 16, seed=2)
    query = torch.randn(1, num_heads, nope + ROPE, generator=gen)
    expected = MLAAttention._attend_absorbed(layer, query, batch["contexts"][0])
    batch["q_latent"] = torch.einsum("qhn,hnr->qhr", query[..., :nope], layer.w_uk)
    batch["q_pe"] = query[..., nope:].clone()
    out_latent = _run(batch, layer.scale, seq_len, partition_size=32)
    torch.testing.assert_close(torch.einsum("qhr,hvr->qhv", out_latent, layer.w_uv), expected)


@pytest.mark.parametrize("rank", [24, 8])
def test_kv_lora_rank_the_kernel_cannot_tile_is_refused(rank: int) -> None:
    with pytest.raises(ValueError, match=f"kv_lora_rank must be a power of two >= 16 .* got {rank}"):
        check_mla_dims(rank)


def test_bench_mla_inputs_and_call() -> None:
    """``pagedllm bench mla``'s defaults (K1's batch and contexts, V2-Lite's latent) and its call of
    the kernel on the paged inputs it builds, against the naive reference over each sequence's
    blocks read back through its block table (tiny float32 shape, on the CPU)."""
    import argparse

    from pagedllm.entrypoints.bench import mla as bench_mla

    parser = argparse.ArgumentParser()
    bench_mla.add_cli_args(parser)
    defaults = parser.parse_args([])
    assert [c.label for c in defaults.contexts] == ["512", "4096", "16384", "1-8192"]
    assert (defaults.batch_size, defaults.num_heads, defaults.kv_lora_rank, defaults.qk_rope_head_dim) == (
        64,
        16,
        512,
        64,
    )
    args = parser.parse_args(
        [
            "--num-heads",
            "5",
            "--kv-lora-rank",
            "32",
            "--qk-rope-head-dim",
            "8",
            "--block-size",
            "8",
            "--dtype",
            "float32",
        ]
    )
    seq_lens = (3, 40, 17)
    inputs = bench_mla._inputs(seq_lens, args, DEVICE)
    call, out = bench_mla._ours(inputs, 0.2)
    call()
    for i, seq_len in enumerate(seq_lens):
        blocks = inputs["block_tables"][i, : inputs["pages"][i]].long()
        context = inputs["cache"][blocks].flatten(0, 1)[:seq_len].cpu()
        expected = _naive(inputs["q_latent"][i].cpu(), inputs["q_pe"][i].cpu(), context, 0.2)
        torch.testing.assert_close(out[i].cpu().double(), expected, rtol=1e-4, atol=1e-4)
