// SwiGLU's gate on the CPU: out = silu(gate) * up for x = [gate | up], in the PyTorch
// reference's rounding order (silu computed in float32 and rounded to the dtype, then the
// product rounded). silu's exponential is exp_approx, not torch's: a bf16 result on a rounding tie
// may differ by one ulp. One operator instead of three (a split, silu, an in-place multiply).
//
// Grid: at::parallel_for over rows. Layouts: x [num_tokens, 2 * d] with contiguous rows (any row
// stride), out [num_tokens, d] contiguous, x's dtype.
// Bound: one read of x and one write of out (C1's decode step: 32 x 3,072 in, 32 x 1,536 out).

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include "ops.h"
#include "vec_math.h"

namespace pagedllm_cpu {

namespace {

template <typename scalar_t>
void silu_and_mul_rows(scalar_t* out, const scalar_t* x, int64_t x_stride, int64_t num_tokens, int64_t d) {
  at::parallel_for(0, num_tokens, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const scalar_t* gate = x + t * x_stride;
      const scalar_t* up = gate + d;
      scalar_t* row = out + t * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) {
        const float g = load(gate[i]);
        const float silu = round_to<scalar_t>(g / (1.f + exp_approx(-g)));
        row[i] = store<scalar_t>(silu * load(up[i]));
      }
    }
  });
}

}  // namespace

void silu_and_mul(const at::Tensor& out, const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0,
              "x must be [num_tokens, 2 * d] with contiguous rows");
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.size(0) == x.size(0) && out.size(1) == x.size(1) / 2 &&
                  out.scalar_type() == x.scalar_type(),
              "out must be a contiguous [num_tokens, d] tensor in x's dtype");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul", [&] {
    silu_and_mul_rows(out.mutable_data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(), x.stride(0), x.size(0),
                      out.size(1));
  });
}

}  // namespace pagedllm_cpu
