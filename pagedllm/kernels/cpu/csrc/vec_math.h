// Float helpers the CPU kernels share, written so the compiler vectorises the loops around them.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

namespace pagedllm_cpu {

// Element conversions by bit operations the compiler vectorises. (c10::BFloat16's own conversion
// from float branches on NaN, which keeps loops around it scalar: 2 ns an element, measured.)
inline float load(float x) { return x; }
inline float load(double x) { return static_cast<float>(x); }
inline float load(c10::Half x) { return static_cast<float>(x); }
inline float load(c10::BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

template <typename scalar_t>
inline scalar_t store(float f);
template <>
inline float store<float>(float f) { return f; }
template <>
inline double store<double>(float f) { return f; }
template <>
inline c10::Half store<c10::Half>(float f) { return c10::Half(f); }
template <>
inline c10::BFloat16 store<c10::BFloat16>(float f) {
  // Round to nearest even, as c10 does; NaN stays a quiet NaN.
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const bool nan = (bits & 0x7fffffffu) > 0x7f800000u;
  return c10::BFloat16(static_cast<uint16_t>(nan ? 0x7fc0u : rounded), c10::BFloat16::from_bits());
}

// f rounded to scalar_t's precision, back in float: what a PyTorch operator in that dtype yields.
template <typename scalar_t>
inline float round_to(float f) { return load(store<scalar_t>(f)); }

template <typename scalar_t>
inline void to_float(const scalar_t* __restrict src, float* __restrict dst, int64_t n) {
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) dst[d] = load(src[d]);
}

inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t d = 0; d < n; ++d) sum += a[d] * b[d];
  return sum;
}

// exp(x) in a form the compiler vectorises (std::exp is a scalar call): e^x = 2^n * 2^f with
// n = round(x * log2(e)) and |f| <= 1/2, 2^f by its Taylor series to degree 6 (relative error
// below 2e-7, about one float ulp). x is clamped at -87, where e^x is ~1.6e-38, still a normal
// float, so 2^n never needs a subnormal's exponent; past x = 88.7 the exponent field overflows
// into infinity, as e^x does.
inline float exp_approx(float x) {
  const float t = std::min(std::max(x, -87.f) * 1.4426950408889634f, 128.f);
  const float n = (t + 12582912.f) - 12582912.f;  // round to nearest: 1.5 * 2^23 drops the fraction
  const float f = (t - n) * 0.6931471805599453f;  // 2^(t - n) = e^f, |f| <= ln(2) / 2
  float p = 1.f / 720;
  p = p * f + 1.f / 120;
  p = p * f + 1.f / 24;
  p = p * f + 1.f / 6;
  p = p * f + 0.5f;
  p = p * f + 1.f;
  p = p * f + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

}  // namespace pagedllm_cpu
