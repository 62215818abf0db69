// RMSNorm, optionally fused with the residual add before it, in Hugging Face's LlamaRMSNorm
// rounding order: the sum rounded to the input dtype, its statistics in float32, the normalised
// row rounded to the dtype before the weight multiplies it, the product rounded again. Only the
// sum of squares is reduced in another order than torch's, so a bf16 result on a rounding tie
// may differ by one ulp (~3 in 100,000 results). The
// PyTorch formulation spends ~9 dispatched operators a norm on that; at a decode step's 32 rows
// each costs more in dispatch than in arithmetic.
//
// Grid: at::parallel_for over rows; a program normalises whole rows.
// Layouts: x, residual [num_rows, hidden] with contiguous rows (any row stride); weight [hidden]
// contiguous, in x's dtype. Both results are written in place: residual <- x + residual, then
// x <- norm(residual) * weight (the Triton kernel's contract: callers pass tensors they are done
// with).
// Bound: one read of x (and residual), one or two writes: a few KB a row, far below any bandwidth
// limit; the work is the float conversions.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <cmath>
#include <vector>

#include "ops.h"
#include "vec_math.h"

namespace pagedllm_cpu {

namespace {

template <typename scalar_t>
void rms_norm_impl(const at::Tensor& x, const std::optional<at::Tensor>& residual, const at::Tensor& weight,
                   double eps) {
  const int64_t num_rows = x.size(0), hidden = x.size(1);
  scalar_t* x_base = x.mutable_data_ptr<scalar_t>();
  scalar_t* res_base = residual.has_value() ? residual->mutable_data_ptr<scalar_t>() : nullptr;
  const int64_t x_stride = x.stride(0), res_stride = residual.has_value() ? residual->stride(0) : 0;
  const scalar_t* w = weight.const_data_ptr<scalar_t>();
  at::parallel_for(0, num_rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> row(hidden);
    float* __restrict r = row.data();
    for (int64_t i = begin; i < end; ++i) {
      scalar_t* xi = x_base + i * x_stride;
      if (res_base != nullptr) {
        scalar_t* ri = res_base + i * res_stride;
#pragma omp simd
        for (int64_t d = 0; d < hidden; ++d) r[d] = round_to<scalar_t>(load(xi[d]) + load(ri[d]));
#pragma omp simd
        for (int64_t d = 0; d < hidden; ++d) ri[d] = store<scalar_t>(r[d]);  // exact: r is rounded
      } else {
        to_float(xi, r, hidden);
      }
      float squares = 0.f;
#pragma omp simd reduction(+ : squares)
      for (int64_t d = 0; d < hidden; ++d) squares += r[d] * r[d];
      const float inv_rms = 1.f / std::sqrt(squares / static_cast<float>(hidden) + static_cast<float>(eps));
#pragma omp simd
      for (int64_t d = 0; d < hidden; ++d) {
        xi[d] = store<scalar_t>(round_to<scalar_t>(r[d] * inv_rms) * load(w[d]));
      }
    }
  });
}

}  // namespace

void rms_norm(const at::Tensor& x, const std::optional<at::Tensor>& residual, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [num_rows, hidden] with contiguous rows");
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(1) &&
                  weight.scalar_type() == x.scalar_type(),
              "weight must be a contiguous [hidden] tensor in x's dtype");
  if (residual.has_value()) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->stride(1) == 1 && residual->scalar_type() == x.scalar_type(),
                "residual must have x's shape and dtype, with contiguous rows");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm",
                                  [&] { rms_norm_impl<scalar_t>(x, residual, weight, eps); });
}

}  // namespace pagedllm_cpu
