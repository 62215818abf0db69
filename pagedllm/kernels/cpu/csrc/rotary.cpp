// Rotary position embedding (Su et al., 2021), neox style, applied in place to query and key:
// each head's halves (x1, x2) become (x1 cos - x2 sin, x2 cos + x1 sin) at its token's position.
// Numerically the PyTorch reference's: every product rounded to the activations' dtype, then the
// difference or sum rounded (in float32, no fused multiply-add: the pragma below), so results
// equal it bit for bit. The reference spends ~24 dispatched operators a layer on this.
//
// Grid: at::parallel_for over tokens; a program rotates every query and key head of its tokens.
// Layouts: positions [num_tokens] int64 (rows of the table); query [num_tokens, num_heads *
// head_size], key [num_tokens, num_kv_heads * head_size], rows contiguous (any row stride: they
// are views into the fused QKV output); cos_sin_cache [max_position, head_size] holding
// [cos | sin], rows contiguous, in the activations' dtype.
// Bound: one read and write of q and k (C1's decode step: 32 tokens x 15 heads x 64, 60 KB a
// layer); the cost is the per-element rounding, negligible beside dispatch.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include "ops.h"
#include "vec_math.h"

// The reference rounds each product before the sum: a contracted a * b - c * d would not.
#pragma GCC optimize("fp-contract=off")

namespace pagedllm_cpu {

namespace {

template <typename scalar_t>
void rotate_heads(scalar_t* row, int64_t num_heads, int64_t head_size, const scalar_t* cos, const scalar_t* sin) {
  const int64_t half = head_size / 2;
  for (int64_t h = 0; h < num_heads; ++h) {
    scalar_t* x1 = row + h * head_size;
    scalar_t* x2 = x1 + half;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float a = load(x1[i]), b = load(x2[i]), c = load(cos[i]), s = load(sin[i]);
      x1[i] = store<scalar_t>(round_to<scalar_t>(a * c) - round_to<scalar_t>(b * s));
      x2[i] = store<scalar_t>(round_to<scalar_t>(b * c) + round_to<scalar_t>(a * s));
    }
  }
}

}  // namespace

void rotary_embedding(const at::Tensor& positions, const at::Tensor& query, const at::Tensor& key,
                      const at::Tensor& cos_sin_cache, int64_t head_size) {
  TORCH_CHECK(positions.dim() == 1 && positions.scalar_type() == at::kLong && positions.is_contiguous(),
              "positions must be a contiguous int64 [num_tokens] tensor");
  const int64_t num_tokens = positions.size(0);
  TORCH_CHECK(head_size > 0 && head_size % 2 == 0, "head_size must be even");
  for (const at::Tensor* t : {&query, &key}) {
    TORCH_CHECK(t->dim() == 2 && t->size(0) == num_tokens && t->stride(1) == 1 && t->size(1) % head_size == 0,
                "query and key must be [num_tokens, heads * head_size] with contiguous rows");
  }
  TORCH_CHECK(cos_sin_cache.dim() == 2 && cos_sin_cache.size(1) == head_size && cos_sin_cache.stride(1) == 1,
              "cos_sin_cache must be [max_position, head_size] with contiguous rows");
  TORCH_CHECK(query.scalar_type() == key.scalar_type() && key.scalar_type() == cos_sin_cache.scalar_type(),
              "query, key and cos_sin_cache must share one dtype");
  const int64_t* pos = positions.const_data_ptr<int64_t>();
  const int64_t max_position = cos_sin_cache.size(0);
  for (int64_t t = 0; t < num_tokens; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_position, "position ", pos[t], " outside the table of ", max_position);
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "rotary_embedding", [&] {
    scalar_t* q = query.mutable_data_ptr<scalar_t>();
    scalar_t* k = key.mutable_data_ptr<scalar_t>();
    const scalar_t* table = cos_sin_cache.const_data_ptr<scalar_t>();
    const int64_t q_stride = query.stride(0), k_stride = key.stride(0), table_stride = cos_sin_cache.stride(0);
    const int64_t num_heads = query.size(1) / head_size, num_kv_heads = key.size(1) / head_size;
    at::parallel_for(0, num_tokens, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* cos = table + pos[t] * table_stride;
        const scalar_t* sin = cos + head_size / 2;
        rotate_heads(q + t * q_stride, num_heads, head_size, cos, sin);
        rotate_heads(k + t * k_stride, num_kv_heads, head_size, cos, sin);
      }
    });
  });
}

}  // namespace pagedllm_cpu
