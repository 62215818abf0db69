// The host-side entry points of the kernels: plain C++ over raw device pointers, so that the .cu
// files build with nvcc alone and only binding.cpp sees torch. binding.cpp checks every shape,
// dtype and stride described here before it calls in.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace pagedllm {

enum class ScalarType { kFloat32, kFloat16, kBFloat16 };

// Threads per attention thread block (4 warps, as in vLLM's original kernels).
constexpr int kNumThreads = 128;
// Tokens per V2 partition (ops.py's PARTITION_SIZE reads it from the built module).
constexpr int kPartitionSize = 512;

// One cache write: every token's K and V for all KV heads into its slot.
struct CacheWriteParams {
  const void* key;          // [num_tokens, num_kv_heads, head_size], token stride key_stride
  const void* value;        // [num_tokens, num_kv_heads, head_size], token stride value_stride
  void* key_cache;          // [num_blocks, num_kv_heads, head_size / x, block_size, x], contiguous
  void* value_cache;        // [num_blocks, num_kv_heads, head_size, block_size], contiguous
  const int64_t* slot_mapping;  // [num_tokens]; < 0: a padding token, not written
  int num_tokens;
  int num_kv_heads;
  int head_size;
  int block_size;
  int64_t key_stride;
  int64_t value_stride;
  ScalarType dtype;
};

// One decode batch: a single query token per sequence over its paged context.
struct PagedAttentionParams {
  void* out;                  // [num_seqs, num_heads, head_size], contiguous
  const void* query;          // [num_seqs, num_heads, head_size], token stride q_stride
  const void* key_cache;      // [num_blocks, num_kv_heads, head_size / x, block_size, x]
  const void* value_cache;    // [num_blocks, num_kv_heads, head_size, block_size]
  const int* block_tables;    // [num_seqs, max_num_blocks_per_seq]
  const int* seq_lens;        // [num_seqs], each in [1, max_seq_len]
  const float* alibi_slopes;  // [num_heads], or nullptr for no ALiBi bias
  float scale;
  int num_seqs;
  int num_heads;
  int num_kv_heads;
  int head_size;
  int block_size;
  int max_num_blocks_per_seq;
  int max_seq_len;  // a host bound on seq_lens: sizes V1's shared memory and V2's partitions
  int q_stride;
  int kv_block_stride;
  int kv_head_stride;
  ScalarType dtype;
};

// V2's float32 scratch between its two kernels.
struct PartitionWorkspace {
  float* exp_sums;    // [num_seqs, num_heads, max_num_partitions]
  float* max_logits;  // [num_seqs, num_heads, max_num_partitions]
  float* tmp_out;     // [num_seqs, num_heads, max_num_partitions, head_size]
  int max_num_partitions;  // ceil(max_seq_len / kPartitionSize)
};

// Each throws std::invalid_argument for a size it was not built for and std::runtime_error for a
// CUDA error; both reach Python as exceptions through pybind11.
void reshape_and_cache(const CacheWriteParams& params, cudaStream_t stream);
void paged_attention_v1(const PagedAttentionParams& params, cudaStream_t stream);
void paged_attention_v2(const PagedAttentionParams& params, const PartitionWorkspace& workspace,
                        cudaStream_t stream);

}  // namespace pagedllm
