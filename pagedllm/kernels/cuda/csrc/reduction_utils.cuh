// Butterfly reductions over a warp and over a thread block (vLLM's warpReduceSum and
// blockReduceSum; vLLM's qk_max reduction).
//
// __shfl_xor_sync(mask) hands each lane the value of the lane whose index differs in that one bit,
// so after the masks WARP_SIZE/2, ..., LOWEST_MASK every lane holds the reduction over the lanes
// that share its bits below LOWEST_MASK; LOWEST_MASK = 1 reduces the whole warp. A block reduction
// then goes through shared memory: lane 0 of each warp writes its warp's value, and the first
// NUM_WARPS lanes of every warp reduce those and broadcast the result to their warp.
#pragma once

#include "dtype_utils.cuh"

namespace pagedllm {

struct MaxOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

struct SumOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return a + b; }
};

template <int LOWEST_MASK, typename Op>
__device__ __forceinline__ float warp_reduce(float value, Op op) {
#pragma unroll
  for (int mask = WARP_SIZE / 2; mask >= LOWEST_MASK; mask /= 2) {
    value = op(value, __shfl_xor_sync(0xffffffffu, value, mask));
  }
  return value;
}

// Every thread of the block gets the reduction of all threads' values. `red_smem` holds
// NUM_WARPS floats; it is free again when this returns only after the next __syncthreads(), so
// two reductions in a row use disjoint slices (the kernels pass &red_smem[0] and
// &red_smem[NUM_WARPS]). LOWEST_MASK > 1 leaves the lanes below it out of the warp step: the
// caller has made lane groups of that size agree already (or only their first lane counts).
template <int NUM_WARPS, int LOWEST_MASK, typename Op>
__device__ __forceinline__ float block_reduce(float* red_smem, float value, Op op, float identity) {
  const int warp_idx = threadIdx.x / WARP_SIZE;
  const int lane = threadIdx.x % WARP_SIZE;
  value = warp_reduce<LOWEST_MASK>(value, op);
  if (lane == 0) {
    red_smem[warp_idx] = value;
  }
  __syncthreads();
  value = lane < NUM_WARPS ? red_smem[lane] : identity;
#pragma unroll
  for (int mask = NUM_WARPS / 2; mask >= 1; mask /= 2) {
    value = op(value, __shfl_xor_sync(0xffffffffu, value, mask));
  }
  return __shfl_sync(0xffffffffu, value, 0);
}

template <int NUM_WARPS>
__device__ __forceinline__ float block_sum(float* red_smem, float value) {
  return block_reduce<NUM_WARPS, 1>(red_smem, value, SumOp{}, 0.f);
}

}  // namespace pagedllm
