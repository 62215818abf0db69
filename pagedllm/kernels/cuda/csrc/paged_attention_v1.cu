// PagedAttention V1 (vLLM's original kernel): one thread block per (query head, sequence) over the
// sequence's whole context; the kernel body is paged_attention.cuh.
//
// Grid (num_heads, num_seqs), kNumThreads threads. Dynamic shared memory holds a float logit for
// every token of the longest sequence (rounded up to whole cache blocks): 32 KB at 8192 tokens,
// past the default 48 KB limit beyond 12288 tokens, where the launcher raises the kernel's limit
// up to what the device allows. Bytes and FLOPs: see paged_attention.cuh; the output is
// num_seqs * num_heads * head_size elements, written once.
#include "dispatch_utils.cuh"
#include "ops.h"
#include "paged_attention.cuh"

namespace pagedllm {
namespace {

template <typename scalar_t, int HEAD_SIZE, int BLOCK_SIZE, int NUM_THREADS>
__global__ void __launch_bounds__(NUM_THREADS) paged_attention_v1_kernel(
    scalar_t* __restrict__ out,             // [num_seqs, num_heads, head_size]
    const scalar_t* __restrict__ q,         // [num_seqs, num_heads, head_size]
    const scalar_t* __restrict__ k_cache,   // [num_blocks, num_kv_heads, head_size/x, block_size, x]
    const scalar_t* __restrict__ v_cache,   // [num_blocks, num_kv_heads, head_size, block_size]
    const int num_queries_per_kv,
    const float scale,
    const int* __restrict__ block_tables,   // [num_seqs, max_num_blocks_per_seq]
    const int* __restrict__ seq_lens,       // [num_seqs]
    const int max_num_blocks_per_seq,
    const float* __restrict__ alibi_slopes,  // [num_heads] or nullptr
    const int q_stride,
    const int kv_block_stride,
    const int kv_head_stride) {
  paged_attention_kernel<scalar_t, scalar_t, HEAD_SIZE, BLOCK_SIZE, NUM_THREADS, 0>(
      nullptr, nullptr, out, q, k_cache, v_cache, num_queries_per_kv, scale, block_tables, seq_lens,
      max_num_blocks_per_seq, alibi_slopes, q_stride, kv_block_stride, kv_head_stride);
}

// Kernels may use 48 KB of dynamic shared memory without opting in.
constexpr int kDefaultMaxSharedMem = 48 * 1024;

template <typename scalar_t, int HEAD_SIZE, int BLOCK_SIZE>
void launch_v1(const PagedAttentionParams& p, cudaStream_t stream) {
  auto kernel = paged_attention_v1_kernel<scalar_t, HEAD_SIZE, BLOCK_SIZE, kNumThreads>;
  const int padded_max_seq_len = ceil_div(p.max_seq_len, BLOCK_SIZE) * BLOCK_SIZE;
  const int shared_mem_size = attention_shared_mem_bytes<HEAD_SIZE, kNumThreads>(padded_max_seq_len);
  if (shared_mem_size > kDefaultMaxSharedMem) {
    int device = 0;
    int max_shared_mem = 0;
    check_cuda(cudaGetDevice(&device), "cudaGetDevice");
    check_cuda(cudaDeviceGetAttribute(&max_shared_mem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
               "cudaDeviceGetAttribute");
    if (shared_mem_size > max_shared_mem) {
      throw std::invalid_argument("paged_attention_v1: max_seq_len " + std::to_string(p.max_seq_len) + " needs " +
                                  std::to_string(shared_mem_size) + " bytes of shared memory for its logits; the " +
                                  "device allows " + std::to_string(max_shared_mem) + ": use paged_attention_v2");
    }
    check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, shared_mem_size),
               "cudaFuncSetAttribute");
  }
  const dim3 grid(p.num_heads, p.num_seqs, 1);
  kernel<<<grid, kNumThreads, shared_mem_size, stream>>>(
      static_cast<scalar_t*>(p.out), static_cast<const scalar_t*>(p.query),
      static_cast<const scalar_t*>(p.key_cache), static_cast<const scalar_t*>(p.value_cache),
      p.num_heads / p.num_kv_heads, p.scale, p.block_tables, p.seq_lens, p.max_num_blocks_per_seq, p.alibi_slopes,
      p.q_stride, p.kv_block_stride, p.kv_head_stride);
  check_cuda(cudaGetLastError(), "paged_attention_v1 launch");
}

}  // namespace

void paged_attention_v1(const PagedAttentionParams& params, cudaStream_t stream) {
  dispatch_scalar_type(params.dtype, [&](auto scalar_tag) {
    using scalar_t = typename decltype(scalar_tag)::type;
    dispatch_head_size(params.head_size, [&](auto head_size) {
      dispatch_block_size(params.block_size, [&](auto block_size) {
        launch_v1<scalar_t, decltype(head_size)::value, decltype(block_size)::value>(params, stream);
      });
    });
  });
}

}  // namespace pagedllm
