"""One rank of the tensor-parallel layer test (test_layers.py starts two, over gloo).

Every rank builds the same full weights and inputs from the same seed, loads its shards through the
layers' weight loaders, and checks that its sharded computation (with the collectives) equals the
single-device one. Usage: python tp_worker.py RANK WORLD_SIZE INIT_FILE
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from pagedllm.distributed import (
    destroy_distributed_environment,
    get_tensor_model_parallel_rank,
    init_distributed_environment,
    tensor_model_parallel_all_gather,
)
from pagedllm.layers.activation import SiluAndMul
from pagedllm.layers.fused_moe import FusedMoE, fused_experts_torch, select_experts
from pagedllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedllm.layers.logits_processor import LogitsProcessor
from pagedllm.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

HIDDEN, HEAD_SIZE, NUM_HEADS, INTERMEDIATE = 16, 4, 4, 12


def check_qkv_with_replicated_kv_head(x: torch.Tensor) -> None:
    """One KV head on two ranks: each rank keeps its 2 query heads and a replica of the KV head."""
    wq, wk, wv = torch.randn(16, HIDDEN), torch.randn(4, HIDDEN), torch.randn(4, HIDDEN)
    bq, bk, bv = torch.randn(16), torch.randn(4), torch.randn(4)
    layer = QKVParallelLinear(HIDDEN, HEAD_SIZE, NUM_HEADS, 1, bias=True)
    for shard_id, w, b in (("q", wq, bq), ("k", wk, bk), ("v", wv, bv)):
        layer.weight.weight_loader(layer.weight, w, shard_id)
        layer.bias.weight_loader(layer.bias, b, shard_id)
    rows = slice(8 * get_tensor_model_parallel_rank(), 8 * get_tensor_model_parallel_rank() + 8)
    expected = F.linear(x, torch.cat([wq[rows], wk, wv]), torch.cat([bq[rows], bk, bv]))
    torch.testing.assert_close(layer(x), expected)


def check_mlp(x: torch.Tensor) -> None:
    """Merged column-parallel gate/up, then row-parallel down with its all-reduce and bias."""
    w_gate, w_up = torch.randn(INTERMEDIATE, HIDDEN), torch.randn(INTERMEDIATE, HIDDEN)
    w_down, b_down = torch.randn(HIDDEN, INTERMEDIATE), torch.randn(HIDDEN)
    gate_up = MergedColumnParallelLinear(HIDDEN, [INTERMEDIATE] * 2, bias=False)
    gate_up.weight.weight_loader(gate_up.weight, w_gate, 0)
    gate_up.weight.weight_loader(gate_up.weight, w_up, 1)
    down = RowParallelLinear(INTERMEDIATE, HIDDEN, bias=True)
    down.weight.weight_loader(down.weight, w_down)
    down.bias.weight_loader(down.bias, b_down)
    expected = F.linear(F.silu(x @ w_gate.T) * (x @ w_up.T), w_down, b_down)
    torch.testing.assert_close(down(SiluAndMul()(gate_up(x))), expected)


def check_vocab_embedding_and_logits(x: torch.Tensor) -> None:
    """An odd vocabulary (11 -> padded to 12, 6 rows per rank): lookups and logits of every id."""
    vocab_size = 11
    table = torch.randn(vocab_size, HIDDEN)
    embedding = VocabParallelEmbedding(vocab_size, HIDDEN)
    embedding.weight.weight_loader(embedding.weight, table)
    ids = torch.arange(vocab_size)
    torch.testing.assert_close(embedding(ids), table)
    lm_head = ParallelLMHead(vocab_size, HIDDEN)
    lm_head.weight.weight_loader(lm_head.weight, table)
    logits = LogitsProcessor(vocab_size)(lm_head, x)
    assert logits.dtype == torch.float32 and logits.shape == (x.shape[0], vocab_size)
    torch.testing.assert_close(logits, x @ table.T)


def check_fused_moe(x: torch.Tensor) -> None:
    """Experts sharded along the intermediate dimension, loaded per expert and stacked: each rank's
    partial output, all-reduced, equals the whole layer's."""
    num_experts, top_k = 4, 2
    w13 = torch.randn(num_experts, 2 * INTERMEDIATE, HIDDEN)
    w2 = torch.randn(num_experts, HIDDEN, INTERMEDIATE)
    logits = torch.randn(x.shape[0], num_experts)
    expected = fused_experts_torch(x, w13, w2, *select_experts(logits, top_k, renormalize=True))
    per_expert = FusedMoE(num_experts, top_k, HIDDEN, INTERMEDIATE, renormalize=True)
    for e in range(num_experts):
        gate, up = w13[e].chunk(2)
        per_expert.gate_up_proj.weight_loader(per_expert.gate_up_proj, gate, (e, 0))
        per_expert.gate_up_proj.weight_loader(per_expert.gate_up_proj, up, (e, 1))
        per_expert.down_proj.weight_loader(per_expert.down_proj, w2[e], (e, None))
    stacked = FusedMoE(num_experts, top_k, HIDDEN, INTERMEDIATE, renormalize=True)
    stacked.gate_up_proj.weight_loader(stacked.gate_up_proj, w13)
    stacked.down_proj.weight_loader(stacked.down_proj, w2)
    assert per_expert.down_proj.shape == (num_experts, HIDDEN, INTERMEDIATE // 2)
    assert torch.equal(per_expert.gate_up_proj, stacked.gate_up_proj)
    torch.testing.assert_close(per_expert(x, logits), expected)
    torch.testing.assert_close(stacked(x, logits), expected)


def check_all_gather() -> None:
    rank = get_tensor_model_parallel_rank()
    local = torch.full((2, 3), float(rank))
    gathered = tensor_model_parallel_all_gather(local, dim=-1)
    torch.testing.assert_close(gathered, torch.cat([torch.zeros(2, 3), torch.ones(2, 3)], dim=-1))


def main(rank: int, world_size: int, init_file: str) -> None:
    init_distributed_environment(world_size, rank, f"file://{init_file}")
    torch.manual_seed(0)
    x = torch.randn(5, HIDDEN)
    try:
        check_qkv_with_replicated_kv_head(x)
        check_mlp(x)
        check_vocab_embedding_and_logits(x)
        check_fused_moe(x)
        check_all_gather()
    finally:
        destroy_distributed_environment()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
