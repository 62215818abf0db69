// y = x W^T for a few rows of x (one stream's decode: 1 to 4 rows) and a weight in the layout of
// torch's int4 CPU kernel (aten._convert_weight_to_int4pack_for_cpu), w = (q - 8) * scale + zero
// per group of 32 inputs. Per group g and output n, with the group's activation sum sx_g:
//   y[n] += scale[g, n] * (sum_k x_k q[n, k] - 8 sx_g) + zero[g, n] * sx_g,
// so the 4-bit values multiply the activations as they are and the group's scale and zero apply
// once per group. Float32 throughout; the output rounded to bf16.
//
// Why: at one row the product is a read of the weight (0.625 bytes a weight with its scales);
// torch's kernel reads SmolLM2's 120 layer weights of a step (66 MB) at ~25 GB/s, its threads
// joining after each. Here a thread streams its output blocks' bytes with prefetches ahead.
//
// Grid: at::parallel_for over blocks of 64 outputs; a program computes its blocks for every row.
// Layouts: x [M, K] bf16, rows contiguous; packed uint8 [N / 64, K, 32]: byte j of input k of
// block b holds q[64 b + j, k] in its low nibble and q[64 b + 32 + j, k] in its high one;
// scales_and_zeros bf16 [K / 32, N, 2]; out [M, N] bf16 contiguous.
// Bound: N K / 2 + 4 N K / 32 bytes read once per call; 2 M N K FLOPs.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#endif

#include "int4_layout.h"
#include "ops.h"

namespace pagedllm_cpu {

namespace {

constexpr int64_t kMaxRows = 4;

#if defined(__AVX512F__) && defined(__AVX512BW__)
// Rows [0, R) of x against output block b.
template <int R>
void block_rows(const float* x, const float* group_sums, const uint8_t* block, const c10::BFloat16* sz, int64_t K,
                int64_t N, int64_t b, c10::BFloat16* out) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < 4; ++i) acc[r][i] = _mm512_setzero_ps();
  const __m256i low_nibbles = _mm256_set1_epi8(0x0F);
  for (int64_t g = 0; g < K / kGroup; ++g) {
    __m512 partial[R][4];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < 4; ++i) partial[r][i] = _mm512_setzero_ps();
    const uint8_t* bytes = block + g * kGroup * 32;
    // Two groups ahead (2 KB) and the scales a group ahead: a group's bytes run on, but its scales
    // sit a row of N pairs after the last group's, a stride the hardware prefetchers miss.
    for (int line = 0; line < 16; ++line) _mm_prefetch(reinterpret_cast<const char*>(bytes) + 2048 + 64 * line, _MM_HINT_T0);
    if (g + 1 < K / kGroup) {
      const char* next_pairs = reinterpret_cast<const char*>(sz + ((g + 1) * N + b * kBlockN) * 2);
      for (int line = 0; line < 4; ++line) _mm_prefetch(next_pairs + 64 * line, _MM_HINT_T0);
    }
    for (int64_t kk = 0; kk < kGroup; ++kk) {
      const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes + kk * 32));
      const __m256i lo = _mm256_and_si256(packed, low_nibbles);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low_nibbles);
      const __m512 q[4] = {
          _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(lo))),
          _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(lo, 1))),
          _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(hi))),
          _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(hi, 1))),
      };
      for (int r = 0; r < R; ++r) {
        const __m512 xk = _mm512_set1_ps(x[r * K + g * kGroup + kk]);
        for (int i = 0; i < 4; ++i) partial[r][i] = _mm512_fmadd_ps(q[i], xk, partial[r][i]);
      }
    }
    // (scale, zero) pairs of the block's 64 outputs: 32-bit lanes of scale | zero << 16.
    const c10::BFloat16* pairs = sz + (g * N + b * kBlockN) * 2;
    for (int i = 0; i < 4; ++i) {
      const __m512i lanes = _mm512_loadu_si512(pairs + 32 * i);
      const __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(lanes, 16));
      const __m512 zero = _mm512_castsi512_ps(_mm512_and_si512(lanes, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
      for (int r = 0; r < R; ++r) {
        const __m512 sx = _mm512_set1_ps(group_sums[r * (K / kGroup) + g]);
        const __m512 centred = _mm512_fnmadd_ps(_mm512_set1_ps(8.f), sx, partial[r][i]);  // sum x q - 8 sx
        acc[r][i] = _mm512_fmadd_ps(zero, sx, _mm512_fmadd_ps(scale, centred, acc[r][i]));
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int i = 0; i < 4; ++i) {
      alignas(64) float values[16];
      _mm512_store_ps(values, acc[r][i]);
      c10::BFloat16* o = out + r * N + b * kBlockN + 16 * i;
      for (int l = 0; l < 16; ++l) o[l] = store<c10::BFloat16>(values[l]);
    }
  }
}
#else
template <int R>
void block_rows(const float* x, const float* group_sums, const uint8_t* block, const c10::BFloat16* sz, int64_t K,
                int64_t N, int64_t b, c10::BFloat16* out) {
  for (int r = 0; r < R; ++r) {
    float acc[kBlockN] = {};
    for (int64_t g = 0; g < K / kGroup; ++g) {
      float partial[kBlockN] = {};
      for (int64_t kk = 0; kk < kGroup; ++kk) {
        const uint8_t* bytes = block + (g * kGroup + kk) * 32;
        const float xk = x[r * K + g * kGroup + kk];
        for (int64_t j = 0; j < 32; ++j) {
          partial[j] += static_cast<float>(bytes[j] & 0x0F) * xk;
          partial[j + 32] += static_cast<float>(bytes[j] >> 4) * xk;
        }
      }
      const float sx = group_sums[r * (K / kGroup) + g];
      for (int64_t n = 0; n < kBlockN; ++n) {
        const c10::BFloat16* pair = sz + (g * N + b * kBlockN + n) * 2;
        acc[n] += load(pair[0]) * (partial[n] - 8.f * sx) + load(pair[1]) * sx;
      }
    }
    for (int64_t n = 0; n < kBlockN; ++n) out[r * N + b * kBlockN + n] = store<c10::BFloat16>(acc[n]);
  }
}
#endif

}  // namespace

void int4_matmul_few_rows(const at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
                          const at::Tensor& scales_and_zeros) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "x must be a contiguous bf16 [M, K] tensor");
  const auto [N, K] = check_int4_weight(packed, scales_and_zeros);
  const int64_t M = x.size(0);
  TORCH_CHECK(x.size(1) == K, "x must have K = packed.size(1) * 2 columns");
  TORCH_CHECK(out.scalar_type() == at::kBFloat16 && out.is_contiguous() && out.dim() == 2 && out.size(0) == M &&
                  out.size(1) == N,
              "out must be a contiguous bf16 [M, N] tensor");
  // The activations in float32 and each group's sum, once per call.
  std::vector<float> xf(M * K), group_sums(M * (K / kGroup), 0.f);
  to_float(x.const_data_ptr<c10::BFloat16>(), xf.data(), M * K);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t k = 0; k < K; ++k) group_sums[r * (K / kGroup) + k / kGroup] += xf[r * K + k];
  const uint8_t* weight = packed.const_data_ptr<uint8_t>();
  const c10::BFloat16* sz = scales_and_zeros.const_data_ptr<c10::BFloat16>();
  c10::BFloat16* y = out.mutable_data_ptr<c10::BFloat16>();
  at::parallel_for(0, N / kBlockN, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const uint8_t* block = weight + b * K * 32;
      for (int64_t r0 = 0; r0 < M; r0 += kMaxRows) {
        const float* xr = xf.data() + r0 * K;
        const float* sums = group_sums.data() + r0 * (K / kGroup);
        c10::BFloat16* yr = y + r0 * N;
        switch (std::min(kMaxRows, M - r0)) {
          case 1: block_rows<1>(xr, sums, block, sz, K, N, b, yr); break;
          case 2: block_rows<2>(xr, sums, block, sz, K, N, b, yr); break;
          case 3: block_rows<3>(xr, sums, block, sz, K, N, b, yr); break;
          default: block_rows<4>(xr, sums, block, sz, K, N, b, yr);
        }
      }
    }
  });
}

}  // namespace pagedllm_cpu
