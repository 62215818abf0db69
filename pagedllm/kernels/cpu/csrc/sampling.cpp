// What the CPU sampler needs of each row of logits, in one read of it: the first index of its
// maximum (the greedy token, as torch.argmax picks it) and its log-sum-exp (a token's logprob is
// its logit minus it), instead of a [rows, vocab] log_softmax written out and read back.
//
// Grid: at::parallel_for over rows. A row is read in chunks of kChunk logits: the chunk's
// maximum first; when it beats the running one, its first position becomes the argmax and the
// running sum is rescaled by exp(old max - new max); then the chunk's exp(x - max) are summed
// (the online softmax of Milakov & Gimelshein, 2018). Float32 throughout.
//
// Layouts: logits [num_rows, vocab] float32, rows contiguous (any row stride); outputs [num_rows]
// int64 and float32.
//
// Bound: one read of the logits (C1's step: 32 rows of 49,152, 6 MB), against log_softmax's read,
// write and re-read for the gather, plus argmax's own read.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <cmath>
#include <limits>

#include "ops.h"
#include "vec_math.h"

namespace pagedllm_cpu {

namespace {
constexpr int64_t kChunk = 1024;
}

void argmax_logsumexp(const at::Tensor& logits, const at::Tensor& argmax, const at::Tensor& logsumexp) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "logits must be [num_rows, vocab] float32 with contiguous rows");
  const int64_t num_rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(vocab > 0, "logits need at least one column");
  TORCH_CHECK(argmax.scalar_type() == at::kLong && argmax.is_contiguous() && argmax.numel() == num_rows,
              "argmax must be a contiguous int64 tensor of num_rows");
  TORCH_CHECK(logsumexp.scalar_type() == at::kFloat && logsumexp.is_contiguous() && logsumexp.numel() == num_rows,
              "logsumexp must be a contiguous float32 tensor of num_rows");
  const float* base = logits.const_data_ptr<float>();
  const int64_t row_stride = logits.stride(0);
  int64_t* argmax_out = argmax.mutable_data_ptr<int64_t>();
  float* lse_out = logsumexp.mutable_data_ptr<float>();
  at::parallel_for(0, num_rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const float* x = base + row * row_stride;
      float running_max = -std::numeric_limits<float>::infinity(), sum = 0.f;
      int64_t best = 0;
      for (int64_t start = 0; start < vocab; start += kChunk) {
        const int64_t n = std::min(kChunk, vocab - start);
        const float* c = x + start;
        float chunk_max = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : chunk_max)
        for (int64_t i = 0; i < n; ++i) chunk_max = std::max(chunk_max, c[i]);
        if (chunk_max > running_max) {
          int64_t i = 0;
          while (c[i] != chunk_max) ++i;
          best = start + i;
          sum *= std::exp(running_max - chunk_max);  // 0 on the first chunk
          running_max = chunk_max;
        }
        float chunk_sum = 0.f;
        const float m = running_max;
#pragma omp simd reduction(+ : chunk_sum)
        for (int64_t i = 0; i < n; ++i) chunk_sum += exp_approx(c[i] - m);
        sum += chunk_sum;
      }
      argmax_out[row] = best;
      lse_out[row] = running_max + std::log(sum);
    }
  });
}

}  // namespace pagedllm_cpu
