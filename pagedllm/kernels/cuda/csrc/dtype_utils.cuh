// Vector types and float conversions for the three cache dtypes (vLLM's Vec, FloatVec and
// from_float, written over CUDA's own half and __nv_bfloat16 types).
//
// A Vec<T, N> is N elements held as one aligned register tuple: a thread that dereferences a
// `const Vec<half, 8>*` issues a single 16-byte load (LDG.E.128), which is how every kernel here
// reads the cache 16 bytes at a time. All arithmetic on the elements is done in float: the kernels
// are bound by memory, so float FMAs cost nothing and keep the dot products as accurate as the
// float32 oracle they are tested against.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace pagedllm {

constexpr int WARP_SIZE = 32;

// 16 bytes at most: the widest single load a thread can issue. A Vec of 8 floats (logits read
// against a 16-bit V vector) is two such loads.
template <typename T, int N>
struct alignas(sizeof(T) * N < 16 ? sizeof(T) * N : 16) Vec {
  T data[N];
};

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

__device__ __forceinline__ void from_float(float& dst, float v) { dst = v; }
__device__ __forceinline__ void from_float(half& dst, float v) { dst = __float2half_rn(v); }
__device__ __forceinline__ void from_float(__nv_bfloat16& dst, float v) { dst = __float2bfloat16_rn(v); }

// sum_i a[i] * b[i] over one vector, in float.
template <typename A, typename B, int N>
__device__ __forceinline__ float dot(const Vec<A, N>& a, const Vec<B, N>& b) {
  float acc = 0.f;
#pragma unroll
  for (int i = 0; i < N; i++) {
    acc = fmaf(to_float(a.data[i]), to_float(b.data[i]), acc);
  }
  return acc;
}

}  // namespace pagedllm
