"""DeepSeek-V2 (``DeepseekV2ForCausalLM``: DeepSeek-V2, V2-Lite, V2.5): multi-head latent
attention (MLA, DeepSeek-AI 2024, "DeepSeek-V2") and a mixture of experts with shared experts, as
Hugging Face transformers computes it.

MLA compresses each token's keys and values into one latent: ``c_kv = RMSNorm(W_dkv x)`` of
``kv_lora_rank`` dims, plus one rotary key ``k_pe`` of ``qk_rope_head_dim`` dims shared by every
head. The cache holds exactly that, ``[c_kv | k_pe]``, one "head" of ``kv_lora_rank +
qk_rope_head_dim`` per token (``ModelConfig.head_size`` and ``num_kv_heads`` say so to the cache
engine): 576 numbers a token for DeepSeek-V2 against 128 heads x (192 + 128) for its keys and
values expanded. Prefill attends in the expanded form (``_attend``): it expands them with
``kv_b_proj`` into every head's ``k_nope`` and ``v``, appends ``k_pe`` and attends, causal. Decode
attends in the absorbed form (``_attend_absorbed``), as DeepSeek and vLLM do: ``kv_b_proj`` folds
into the query and the output, and attention runs as MQA over the latents directly. The engine
allocates no value cache beside the latents (``KVCacheSpec.keys_only``). On the torch and cpu
backends (the oracle) a step runs a sequence at a time (``_step_per_sequence``); on the Triton
backend every decode of the step runs in one kernel launch (``models/mla_paged.py``), the cache the
Triton layout of one KV head, the same memory as the torch layout's.

Rotary embedding: DeepSeek rotates interleaved pairs ``(x[2i], x[2i + 1])`` (complex
multiplication in the reference), with the usual angles and YaRN's attention factor; the softmax
scale is ``qk_head_dim ** -0.5`` times ``mscale(factor, mscale_all_dim) ** 2`` under YaRN.

MoE: layers ``>= first_k_dense_replace`` route with a softmax, top-k within the ``topk_group``
best groups (``group_limited_greedy``) or over all experts (``greedy``), weights times
``routed_scaling_factor`` without renormalising, plus ``n_shared_experts`` shared experts.
"""

from __future__ import annotations

import functools
import math
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from pagedllm.attention.backends.abstract import AttentionBackend
from pagedllm.attention.backends.torch_backend import gather_context
from pagedllm.attention.forward_context import get_forward_context
from pagedllm.attention.layer import AttentionLayerBase
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.layers.fused_moe import select_experts_group_limited
from pagedllm.layers.layernorm import RMSNorm
from pagedllm.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from pagedllm.layers.rotary_embedding import RotaryEmbedding, get_rope_parameters
from pagedllm.models.glm4_moe import SharedExpertsMoeBlock
from pagedllm.models.llama import LlamaDecoderLayer, LlamaMLP
from pagedllm.models.moe import MoeForCausalLM

# The backends MLA runs on: the torch and cpu backends' per-sequence loop (the oracle), the Triton
# backend's decode kernel (models/mla_paged.py). A cache of one KV head is [num_blocks, block_size,
# r + rope] in memory in both their layouts; the CUDA backend's chunked key layout is not.
_MLA_BACKENDS = ("torch", "cpu", "triton")


def _softmax_scale(config: PretrainedConfig, qk_head_dim: int) -> float:
    params = get_rope_parameters(config)
    scale = qk_head_dim**-0.5
    mscale_all_dim = params.get("mscale_all_dim") or 0
    if params["rope_type"] == "yarn" and mscale_all_dim and params["factor"] > 1:
        mscale = 0.1 * mscale_all_dim * math.log(params["factor"]) + 1.0
        scale *= mscale * mscale
    return scale


def _rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, heads, rope_dim], pairs (2i, 2i + 1) rotated by angle i; cos, sin:
    [num_tokens, 1, rope_dim // 2]. Computed in float32, as the reference's complex product."""
    pairs = x.float().unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    cos, sin = cos.float(), sin.float()
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2).to(x.dtype)


def _rotate_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """As ``_rotate_interleaved`` with pairs (i, i + rope_dim // 2): DeepSeek-V3's checkpoints
    converted with ``rope_interleave=False``."""
    first, second = x.float().chunk(2, dim=-1)
    cos, sin = cos.float(), sin.float()
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1).to(x.dtype)


class MLAAttention(AttentionLayerBase):
    def __init__(
        self,
        config: PretrainedConfig,
        rotary_emb: RotaryEmbedding | None,
        attn_backend: type[AttentionBackend],
        sliding_window: int | None,
    ) -> None:
        super().__init__()
        if attn_backend.name not in _MLA_BACKENDS:
            raise ValueError(
                f"multi-head latent attention (DeepSeek-V2) runs on the attention backends "
                f"{_MLA_BACKENDS}, got {attn_backend.name!r}"
            )
        if sliding_window is not None or rotary_emb is None:
            raise ValueError(
                "multi-head latent attention takes no sliding window and needs its rotary embedding"
            )
        self.q_lora_rank = config.q_lora_rank
        self.kv_lora_rank = config.kv_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        num_heads, hidden, bias = config.num_attention_heads, config.hidden_size, config.attention_bias
        if self.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, num_heads * self.qk_head_dim, bias=False)
        else:
            self.q_a_proj = ReplicatedLinear(hidden, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, 1e-6)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, num_heads * self.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = ReplicatedLinear(
            hidden, self.kv_lora_rank + self.qk_rope_head_dim, bias=bias
        )
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, 1e-6)
        per_head = self.qk_nope_head_dim + self.v_head_dim
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora_rank, num_heads * per_head, bias=False)
        self.o_proj = RowParallelLinear(num_heads * self.v_head_dim, hidden, bias=bias)
        self.num_heads = self.kv_b_proj.weight.shape[0] // per_head  # this rank's heads
        self.rotary_emb = rotary_emb
        # DeepSeek-V3's config may lay the rope dims out as halves; V2's are always interleaved.
        # (Only q . k matters, so the rotated dims' order need not match the reference's.)
        interleaved = getattr(config, "rope_interleave", True)
        self._rotate = _rotate_interleaved if interleaved else _rotate_halves
        self.scale = _softmax_scale(config, self.qk_head_dim)
        # The path, chosen here once: the oracle's per-sequence loop, or the Triton decode kernel
        # (imported for that path only: triton is an optional dependency).
        self._attend_step = self._step_per_sequence
        if attn_backend.name == "triton":
            from pagedllm.models.mla_paged import check_mla_dims, step_paged

            check_mla_dims(self.kv_lora_rank)
            self._attend_step = functools.partial(step_paged, self)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """positions: [num_tokens]; hidden_states: [num_tokens, hidden_size] -> same shape. Writes
        the tokens' latents into this layer's ``kv_cache`` (bound by ``bind_kv_caches``)."""
        num_tokens = hidden_states.shape[0]
        if self.q_lora_rank is None:
            q = self.q_proj(hidden_states)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        q = q.view(num_tokens, self.num_heads, self.qk_head_dim)
        latent, k_pe = self.kv_a_proj_with_mqa(hidden_states).split(
            [self.kv_lora_rank, self.qk_rope_head_dim], -1
        )
        table, index = self.rotary_emb.cos_sin_rows(positions)
        cos, sin = table.index_select(0, index)[:, None].chunk(2, dim=-1)
        q_pe = self._rotate(q[..., self.qk_nope_head_dim :], cos, sin)
        q = torch.cat((q[..., : self.qk_nope_head_dim], q_pe), dim=-1)
        k_pe = self._rotate(k_pe[:, None], cos, sin)
        # The cache entry of a token: [c_kv | k_pe], one "head".
        entry = torch.cat((self.kv_a_layernorm(latent)[:, None], k_pe), dim=-1)
        output = self._attend_step(q, entry, self.kv_cache[0], get_forward_context().attn_metadata)
        return self.o_proj(output.flatten(1))

    def _step_per_sequence(
        self, q: torch.Tensor, entry: torch.Tensor, cache: torch.Tensor, md: AttentionMetadata
    ) -> torch.Tensor:
        """The torch and cpu backends' path, and the oracle: q: [num_tokens, num_heads,
        qk_head_dim], entry: [num_tokens, 1, r + rope] -> [num_tokens, num_heads, v_head_dim]. A
        sequence at a time, gathering its latents; decodes absorbed, prefills expanded."""
        valid = md.slot_mapping >= 0
        cache.view(-1, 1, cache.shape[-1])[md.slot_mapping[valid]] = entry[valid].to(cache.dtype)
        output = q.new_empty(q.shape[0], self.num_heads, self.v_head_dim)
        self._attend_sequences(q, cache, md, 0, output)
        return output

    def _attend_sequences(
        self, q: torch.Tensor, cache: torch.Tensor, md: AttentionMetadata, first: int, output: torch.Tensor
    ) -> None:
        """Sequences [first, num_seqs) one at a time, over latents gathered from ``cache`` (either
        layout); writes their rows of ``output``. Reads the host copies of the metadata."""
        by_token = cache.view(cache.shape[0], -1, 1, cache.shape[-1])
        starts = md.query_start_loc_cpu.tolist()
        seq_lens = md.seq_lens_cpu.tolist()
        for i in range(first, md.num_seqs):
            context = gather_context(by_token, md.block_tables[i], seq_lens[i])[:, 0]
            # Decode (one new token) attends over the latents, prefill expands them.
            attend = self._attend_absorbed if starts[i + 1] - starts[i] == 1 else self._attend
            output[starts[i] : starts[i + 1]] = attend(q[starts[i] : starts[i + 1]], context)

    def _attend(self, query: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        """The expanded form. query: [query_len, num_heads, qk_head_dim], the last query_len
        positions of a context of latents [seq_len, kv_lora_rank + qk_rope_head_dim] ->
        [query_len, num_heads, v_head_dim].

        FLOPs ~ 2 seq_len kv_lora_rank H (nope + v) for the expansion plus 2 query_len seq_len H
        (qk_head_dim + v) for attention: the expansion dominates when query_len is small."""
        seq_len, query_len = context.shape[0], query.shape[0]
        latent, k_pe = context.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(latent).view(seq_len, self.num_heads, -1)
        k_nope, values = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        keys = torch.cat((k_nope, k_pe[:, None].expand(-1, self.num_heads, -1)), dim=-1)
        scores = torch.einsum("qhd,khd->hqk", query.float(), keys.float()) * self.scale
        q_pos = torch.arange(seq_len - query_len, seq_len, device=query.device)
        causal = torch.arange(seq_len, device=query.device)[None, :] <= q_pos[:, None]
        probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
        return torch.einsum("hqk,khd->qhd", probs, values.float()).to(query.dtype)

    def process_weights_after_loading(self) -> None:
        """W_UK [num_heads, qk_nope, r] and W_UV [num_heads, v, r] for the absorbed form, read out
        of ``kv_b_proj`` by multiplying the identity, whatever its storage (dense, quantized,
        oneDNN-blocked): once, after loading (the model loader calls it)."""
        identity = torch.eye(
            self.kv_lora_rank,
            dtype=self.kv_a_layernorm.weight.dtype,
            device=self.kv_a_layernorm.weight.device,
        )
        per_head = self.kv_b_proj(identity).T.reshape(self.num_heads, -1, self.kv_lora_rank)
        w_uk, w_uv = per_head.split([self.qk_nope_head_dim, self.v_head_dim], dim=1)
        self.register_buffer("w_uk", w_uk.contiguous(), persistent=False)
        self.register_buffer("w_uv", w_uv.contiguous(), persistent=False)

    def _attend_absorbed(self, query: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        """The absorbed form, as ``_attend`` computes it (same arguments and result).

        With kv_b_proj's rows of head h split into W_UK [qk_nope, r] and W_UV [v, r] (r =
        kv_lora_rank), q_nope . (W_UK c) = (W_UK^T q_nope) . c and sum_k p_k W_UV c_k = W_UV
        (sum_k p_k c_k): the query moves into the latent space, attention runs as MQA with one
        shared "head" [c | k_pe] of r + rope dims per token, and W_UV maps each head's latent
        output back. FLOPs ~ 2 query_len H (r (qk_nope + v) + seq_len (2 r + rope)): nothing
        scales with seq_len x kv_b_proj, which is why decoding takes this form (DeepSeek-V2, s.
        2.1.2; vLLM's MLA backends)."""
        query_len, seq_len = query.shape[0], context.shape[0]
        latent, k_pe = context.float().split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        w_uk, w_uv = self.w_uk.float(), self.w_uv.float()
        q_nope, q_pe = query.float().split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        q_latent = torch.einsum("qhn,hnr->qhr", q_nope, w_uk)
        scores = torch.einsum("qhr,kr->hqk", q_latent, latent) + torch.einsum("qhp,kp->hqk", q_pe, k_pe)
        q_pos = torch.arange(seq_len - query_len, seq_len, device=query.device)
        causal = torch.arange(seq_len, device=query.device)[None, :] <= q_pos[:, None]
        probs = torch.softmax((scores * self.scale).masked_fill(~causal, float("-inf")), dim=-1)
        out_latent = torch.einsum("hqk,kr->qhr", probs, latent)
        return torch.einsum("qhr,hvr->qhv", out_latent, w_uv).to(query.dtype)


class MLADecoderLayer(LlamaDecoderLayer):
    attention_class = MLAAttention


class GroupLimitedRouter(nn.Module):
    """DeepSeek-V2's router weights (``gate.weight``), logits in float32 as the reference's."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(config.n_routed_experts, config.hidden_size), requires_grad=False
        )
        self.top_k = config.num_experts_per_tok
        grouped = config.topk_method == "group_limited_greedy"
        if config.topk_method not in ("greedy", "group_limited_greedy"):
            raise ValueError(
                f"topk_method must be 'greedy' or 'group_limited_greedy', got {config.topk_method!r}"
            )
        if grouped and (not config.n_group or config.n_routed_experts % config.n_group):
            raise ValueError(
                f"n_group ({config.n_group}) must divide n_routed_experts ({config.n_routed_experts})"
            )
        self.num_groups = config.n_group if grouped else None
        self.topk_groups = config.topk_group if grouped else None
        self.routed_scaling_factor = config.routed_scaling_factor

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(hidden_states.float(), self.weight.float())
        return select_experts_group_limited(
            logits, self.top_k, self.num_groups, self.topk_groups, self.routed_scaling_factor
        )


class DeepseekV2ForCausalLM(MoeForCausalLM):
    decoder_layer = MLADecoderLayer
    # MLA's projections load as they are: only the MLPs' gate and up are packed.
    packed_modules_mapping: ClassVar[dict[str, tuple[tuple[str, int | str], ...]]] = {
        "gate_up_proj": (("gate_proj", 0), ("up_proj", 1)),
    }

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_index: int) -> nn.Module:
        if layer_index < config.first_k_dense_replace:
            return LlamaMLP(config)
        return SharedExpertsMoeBlock(config, GroupLimitedRouter(config))
