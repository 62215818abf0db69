// From run-time sizes to template instantiations: the dtype, head sizes and block sizes the
// kernels are built for. A call with any other value throws std::invalid_argument naming it.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <stdexcept>
#include <string>
#include <type_traits>

#include "ops.h"

namespace pagedllm {

template <typename T>
struct TypeTag {
  using type = T;
};

// Calls f(TypeTag<scalar_t>{}) for the element type of `dtype`.
template <typename F>
void dispatch_scalar_type(ScalarType dtype, F&& f) {
  switch (dtype) {
    case ScalarType::kFloat32:
      return f(TypeTag<float>{});
    case ScalarType::kFloat16:
      return f(TypeTag<half>{});
    case ScalarType::kBFloat16:
      return f(TypeTag<__nv_bfloat16>{});
  }
  throw std::invalid_argument("pagedllm: unsupported dtype");
}

// Calls f(std::integral_constant<int, V>{}) for the V in VALUES equal to `value`.
template <int... VALUES, typename F>
void dispatch_int(int value, const char* what, F&& f) {
  const bool found = ((value == VALUES && (f(std::integral_constant<int, VALUES>{}), true)) || ...);
  if (!found) {
    throw std::invalid_argument(std::string("pagedllm: unsupported ") + what + " " + std::to_string(value));
  }
}

// The head sizes and block sizes of the supported grid: every instantiation costs build time, so
// nothing beyond them (pagedllm.kernels.cuda.ops lists the same sets for its checks).
template <typename F>
void dispatch_head_size(int head_size, F&& f) {
  dispatch_int<64, 80, 96, 112, 128, 256>(head_size, "head_size", f);
}

template <typename F>
void dispatch_block_size(int block_size, F&& f) {
  dispatch_int<8, 16, 32>(block_size, "block_size", f);
}

inline void check_cuda(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    throw std::runtime_error(std::string("pagedllm: ") + what + ": " + cudaGetErrorString(status));
  }
}

__host__ __device__ constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }

}  // namespace pagedllm
