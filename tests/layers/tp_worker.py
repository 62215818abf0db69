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
    tensor_model_parallel_all_reduce,
)
from pagedllm.layers.activation import SiluAndMul
from pagedllm.layers.fused_moe import FusedMoE, fused_experts_torch, select_experts
from pagedllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedllm.layers.logits_processor import LogitsProcessor
from pagedllm.layers.quantization.fp8 import ActivationScheme, Fp8Scheme, WeightScheme
from pagedllm.layers.quantization.fp8_moe import Fp8MoEMethod
from pagedllm.layers.quantization.fp8_utils import expand_block_scale, qdq_per_token_group
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


def check_row_parallel_without_reduce(x: torch.Tensor) -> None:
    """``reduce_results=False``: this rank's partial sum (its input columns, the bias on rank 0
    alone), which its caller's all-reduce turns into the whole product."""
    w_down, b_down = torch.randn(HIDDEN, INTERMEDIATE), torch.randn(HIDDEN)
    h = torch.randn(x.shape[0], INTERMEDIATE)
    down = RowParallelLinear(INTERMEDIATE, HIDDEN, bias=True, reduce_results=False)
    down.weight.weight_loader(down.weight, w_down)
    down.bias.weight_loader(down.bias, b_down)
    rank = get_tensor_model_parallel_rank()
    columns = slice(6 * rank, 6 * rank + 6)
    partial = down(h[:, columns])
    torch.testing.assert_close(
        partial, F.linear(h[:, columns], w_down[:, columns], b_down if rank == 0 else None)
    )
    torch.testing.assert_close(tensor_model_parallel_all_reduce(partial), F.linear(h, w_down, b_down))


def check_fused_moe_with_a_shared_expert(x: torch.Tensor) -> None:
    """Qwen3-Next's block: the shared expert's down projection leaves its partial sum unreduced
    (``reduce_results=False``), and the experts fold ``sigmoid(gate) * partial`` into their own
    partial sum before their one all-reduce: the whole layer's output."""
    num_experts, top_k = 4, 2
    w13 = torch.randn(num_experts, 2 * INTERMEDIATE, HIDDEN)
    w2 = torch.randn(num_experts, HIDDEN, INTERMEDIATE)
    w_down, b_down = torch.randn(HIDDEN, INTERMEDIATE), torch.randn(HIDDEN)
    h = torch.randn(x.shape[0], INTERMEDIATE)  # the shared expert's activations, whole
    logits, gate = torch.randn(x.shape[0], num_experts), torch.randn(x.shape[0], 1)
    routed = fused_experts_torch(x, w13, w2, *select_experts(logits, top_k, renormalize=True))
    expected = routed + torch.sigmoid(gate) * F.linear(h, w_down, b_down)
    down = RowParallelLinear(INTERMEDIATE, HIDDEN, bias=True, reduce_results=False)
    down.weight.weight_loader(down.weight, w_down)
    down.bias.weight_loader(down.bias, b_down)
    rank = get_tensor_model_parallel_rank()
    partial = down(h[:, 6 * rank : 6 * rank + 6])
    layer = FusedMoE(num_experts, top_k, HIDDEN, INTERMEDIATE, renormalize=True)
    layer.gate_up_proj.weight_loader(layer.gate_up_proj, w13)
    layer.down_proj.weight_loader(layer.down_proj, w2)
    torch.testing.assert_close(layer(x, logits, shared=partial, shared_gate=gate), expected)


def check_fp8_fused_moe(x: torch.Tensor) -> None:
    """Block-scaled FP8 experts (3 x 3 blocks: 6 intermediate rows per rank, ragged at the hidden
    edge), per-expert weights and scales sharded by FusedMoE's loader: the partial outputs,
    all-reduced, equal the whole layer's dequantized computation."""
    num_experts, top_k, block = 4, 2, (3, 3)
    scheme = Fp8Scheme(WeightScheme.BLOCK, ActivationScheme.DYNAMIC_GROUP, block, "weight_scale_inv")
    checkpoint = {}
    dense = {
        0: torch.empty(num_experts, 2 * INTERMEDIATE, HIDDEN),
        None: torch.empty(num_experts, HIDDEN, INTERMEDIATE),
    }
    for e in range(num_experts):
        for projection, rows in (
            (0, slice(0, INTERMEDIATE)),
            (1, slice(INTERMEDIATE, None)),
            (None, slice(None)),
        ):
            w = torch.randn(HIDDEN, INTERMEDIATE) if projection is None else torch.randn(INTERMEDIATE, HIDDEN)
            scale = torch.rand(-(-w.shape[0] // 3), -(-w.shape[1] // 3)) / 100 + 1e-3
            q = (w / expand_block_scale(scale, block, w.shape)).clamp(-448, 448).to(torch.float8_e4m3fn)
            checkpoint[(e, projection)] = (q, scale)
            dense[0 if projection is not None else None][e, rows] = q.float() * expand_block_scale(
                scale, block, w.shape
            )
    logits = torch.randn(x.shape[0], num_experts)
    qdq = lambda t: qdq_per_token_group(t, 3)  # noqa: E731
    expected = fused_experts_torch(x, dense[0], dense[None], *select_experts(logits, top_k, True), qdq)
    layer = FusedMoE(num_experts, top_k, HIDDEN, INTERMEDIATE, renormalize=True)
    method = Fp8MoEMethod(scheme)
    method.create_weights(layer)
    layer.quant_method = method
    for (e, projection), (q, scale) in checkpoint.items():
        name = "down_proj" if projection is None else "gate_up_proj"
        for param, tensor in ((getattr(layer, name), q), (getattr(layer, f"{name}_weight_scale_inv"), scale)):
            param.weight_loader(param, tensor, (e, projection))
    method.process_weights_after_loading(layer)
    torch.testing.assert_close(layer(x, logits), expected)


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
        check_row_parallel_without_reduce(x)
        check_vocab_embedding_and_logits(x)
        check_fused_moe(x)
        check_fused_moe_with_a_shared_expert(x)
        check_fp8_fused_moe(x)
        check_all_gather()
    finally:
        destroy_distributed_environment()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
