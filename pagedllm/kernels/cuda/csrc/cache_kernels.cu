// reshape_and_cache (vLLM's original kernel): write this step's K and V into the paged cache at each token's slot.
//
// Grid (num_tokens,), min(num_kv_heads * head_size, 512) threads. A thread block copies one token:
// its slot is slot_mapping[token] (block slot / block_size, offset slot % block_size; a negative
// slot marks a padding token, skipped), and its threads stride over the token's num_kv_heads *
// head_size elements, one element of K and one of V each, so the reads are coalesced.
//
// Layouts (x = 16 / sizeof(scalar_t)):
//   reads  key, value    [num_tokens, num_kv_heads, head_size], token strides key_stride / value_stride
//   writes key_cache     [num_blocks, num_kv_heads, head_size / x, block_size, x]: element d of a token
//                        goes to piece d / x, position d % x, so each 16-byte piece of a key is
//                        contiguous, as the attention kernels' thread groups read it;
//          value_cache   [num_blocks, num_kv_heads, head_size, block_size]: a token's values are
//                        block_size apart (each head dimension's row holds the block's tokens).
//
// Bound: a pure copy of 4 * num_tokens * num_kv_heads * head_size * sizeof(scalar_t) bytes (read +
// write, K and V). The V writes are scattered element by element; for a decode step they are ~1 /
// seq_len of the attention kernel's traffic.
#include <algorithm>

#include "dispatch_utils.cuh"
#include "ops.h"

namespace pagedllm {
namespace {

template <typename scalar_t>
__global__ void reshape_and_cache_kernel(
    const scalar_t* __restrict__ key,       // [num_tokens, num_kv_heads, head_size]
    const scalar_t* __restrict__ value,     // [num_tokens, num_kv_heads, head_size]
    scalar_t* __restrict__ key_cache,       // [num_blocks, num_kv_heads, head_size/x, block_size, x]
    scalar_t* __restrict__ value_cache,     // [num_blocks, num_kv_heads, head_size, block_size]
    const int64_t* __restrict__ slot_mapping,  // [num_tokens]
    const int64_t key_stride,
    const int64_t value_stride,
    const int num_kv_heads,
    const int head_size,
    const int block_size,
    const int x) {
  const int64_t token_idx = blockIdx.x;
  const int64_t slot_idx = slot_mapping[token_idx];
  if (slot_idx < 0) {
    return;
  }
  const int64_t block_idx = slot_idx / block_size;
  const int block_offset = static_cast<int>(slot_idx % block_size);
  const int n = num_kv_heads * head_size;
  // One KV head of one block: head_size * block_size elements in either cache.
  const int64_t head_stride = static_cast<int64_t>(head_size) * block_size;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const int head_idx = i / head_size;
    const int head_offset = i % head_size;
    const int x_idx = head_offset / x;
    const int x_offset = head_offset % x;
    const int64_t tgt_head = (block_idx * num_kv_heads + head_idx) * head_stride;
    const int64_t tgt_key_idx = tgt_head + (x_idx * block_size + block_offset) * x + x_offset;
    const int64_t tgt_value_idx = tgt_head + head_offset * block_size + block_offset;
    key_cache[tgt_key_idx] = __ldg(&key[token_idx * key_stride + i]);
    value_cache[tgt_value_idx] = __ldg(&value[token_idx * value_stride + i]);
  }
}

}  // namespace

void reshape_and_cache(const CacheWriteParams& p, cudaStream_t stream) {
  if (p.num_tokens == 0) {
    return;
  }
  dispatch_scalar_type(p.dtype, [&](auto scalar_tag) {
    using scalar_t = typename decltype(scalar_tag)::type;
    const int num_threads = std::min(p.num_kv_heads * p.head_size, 512);
    reshape_and_cache_kernel<scalar_t><<<p.num_tokens, num_threads, 0, stream>>>(
        static_cast<const scalar_t*>(p.key), static_cast<const scalar_t*>(p.value),
        static_cast<scalar_t*>(p.key_cache), static_cast<scalar_t*>(p.value_cache), p.slot_mapping, p.key_stride,
        p.value_stride, p.num_kv_heads, p.head_size, p.block_size, static_cast<int>(16 / sizeof(scalar_t)));
    check_cuda(cudaGetLastError(), "reshape_and_cache launch");
  });
}

}  // namespace pagedllm
