// The int4 weight layout the CPU kernels share (torch's aten._convert_weight_to_int4pack_for_cpu
// with inner K tiles of 2, as layers/quantization/gguf.py packs it), its argument checks, and the
// decoding of one group of it to float32.
//
//   packed uint8 [N / 64, K, 32]: byte j of input k of block b holds q[64 b + j, k] in its low
//     nibble and q[64 b + 32 + j, k] in its high one (q in 0..15);
//   scales_and_zeros bf16 [K / 32, N, 2]: (scale, zero) per group of 32 inputs and output row;
//   w[n, k] = (q[n, k] - 8) * scale + zero.
#pragma once

#include <ATen/core/Tensor.h>

#include "vec_math.h"

namespace pagedllm_cpu {

constexpr int64_t kBlockN = 64;  // output rows of one block of the packing
constexpr int64_t kGroup = 32;   // inputs sharing a (scale, zero) pair

// Checks a packed weight and its scales; returns (N, K).
inline std::pair<int64_t, int64_t> check_int4_weight(const at::Tensor& packed, const at::Tensor& scales_and_zeros) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() == 2 &&
                  packed.size(0) % kBlockN == 0 && (packed.size(1) * 2) % kGroup == 0,
              "packed must be contiguous uint8 [N, K / 2], N a multiple of 64 and K of 32");
  const int64_t N = packed.size(0), K = packed.size(1) * 2;
  TORCH_CHECK(scales_and_zeros.scalar_type() == at::kBFloat16 && scales_and_zeros.is_contiguous() &&
                  scales_and_zeros.dim() == 3 && scales_and_zeros.size(0) == K / kGroup &&
                  scales_and_zeros.size(1) == N && scales_and_zeros.size(2) == 2,
              "scales_and_zeros must be contiguous bf16 [K / 32, N, 2]");
  return {N, K};
}

// The group's (scale, offset = zero - 8 scale) for its 64 outputs, so that w = q * scale + offset.
inline void group_scales(const c10::BFloat16* __restrict pairs, float* __restrict scale, float* __restrict offset) {
  for (int64_t n = 0; n < kBlockN; ++n) {
    scale[n] = load(pairs[2 * n]);
    offset[n] = load(pairs[2 * n + 1]) - 8.f * scale[n];
  }
}

// tile[kk][n] <- w[64 b + n, 32 g + kk] in float32, as q * scale + (zero - 8 scale), for the group
// whose 1 KB of nibbles start at `bytes` ([32 inputs][32 bytes]) and whose 64 (scale, zero) pairs
// start at `pairs`. Rows of 64 outputs, so the arithmetic runs across the bytes in vectors.
inline void decode_group(const uint8_t* __restrict bytes, const c10::BFloat16* __restrict pairs,
                         float (*__restrict tile)[kBlockN]) {
  float scale[kBlockN], offset[kBlockN];
  group_scales(pairs, scale, offset);
  for (int64_t kk = 0; kk < kGroup; ++kk) {
#pragma omp simd
    for (int64_t j = 0; j < 32; ++j) {
      const uint8_t byte = bytes[kk * 32 + j];
      tile[kk][j] = static_cast<float>(byte & 0x0F) * scale[j] + offset[j];
      tile[kk][j + 32] = static_cast<float>(byte >> 4) * scale[j + 32] + offset[j + 32];
    }
  }
}

}  // namespace pagedllm_cpu
