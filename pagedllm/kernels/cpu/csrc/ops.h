// The CPU kernels' entry points, registered as torch.ops.pagedllm_cpu.* in binding.cpp. Each
// checks its arguments (TORCH_CHECK: a RuntimeError naming what is wrong) and writes its outputs.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace pagedllm_cpu {

// cache.cpp: each token's K and V rows into its slot; slots < 0 (padding) skipped.
void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
                       const at::Tensor& value_cache, const at::Tensor& slot_mapping);

// paged_attention.cpp
void paged_attention(
    const at::Tensor& out,
    const at::Tensor& query,
    const at::Tensor& key_cache,
    const at::Tensor& value_cache,
    const at::Tensor& block_tables,
    const at::Tensor& seq_lens,
    const at::Tensor& query_start_loc,
    double scale,
    int64_t sliding_window,
    double logits_soft_cap,
    const std::optional<at::Tensor>& alibi_slopes);

// rms_norm.cpp: with residual, residual <- x + residual first; x <- rms_norm(...) * weight.
void rms_norm(const at::Tensor& x, const std::optional<at::Tensor>& residual, const at::Tensor& weight, double eps);

// rotary.cpp: query and key rotated in place, neox style.
void rotary_embedding(const at::Tensor& positions, const at::Tensor& query, const at::Tensor& key,
                      const at::Tensor& cos_sin_cache, int64_t head_size);

// int4_matmul.cpp: out <- x W^T for a weight packed by aten._convert_weight_to_int4pack_for_cpu.
void int4_matmul_few_rows(const at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
                          const at::Tensor& scales_and_zeros);
// int4_prefill.cpp: whether int4_prefill_matmul runs here (oneDNN's brgemm ukernel on AMX).
bool int4_prefill_supported();
// int4_prefill.cpp: out <- x W^T for such a weight at prefill sizes, a tile of W decoded at a time.
void int4_prefill_matmul(const at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
                         const at::Tensor& scales_and_zeros);
// int4_prefill.cpp: out <- output rows [start, start + out.size(0)) of such a weight, as bf16.
void int4_dequantize(const at::Tensor& out, const at::Tensor& packed, const at::Tensor& scales_and_zeros,
                     int64_t start);

// sampling.cpp
void argmax_logsumexp(const at::Tensor& logits, const at::Tensor& argmax, const at::Tensor& logsumexp);

}  // namespace pagedllm_cpu
