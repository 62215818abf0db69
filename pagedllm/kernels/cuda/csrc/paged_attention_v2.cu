// PagedAttention V2 (vLLM's original kernel): the context split into partitions of kPartitionSize tokens, each
// computed by its own thread block, then a reduce kernel merging the partitions (FlashDecoding's
// split-KV). It keeps the GPU busy when num_seqs * num_heads thread blocks are too few to fill it
// and contexts are long, and bounds shared memory at one partition's logits whatever the length.
//
// Kernel 1, paged_attention_v2_kernel: grid (num_heads, num_seqs, max_num_partitions), kNumThreads
//   threads; the body of paged_attention.cuh over partition blockIdx.z. It writes the partition's
//   softmax-normalized output to tmp_out (float) and its max logit and exp sum; partitions past a
//   sequence's end exit at once and write nothing. 2 KB of dynamic shared memory (the partition's
//   logits). Bytes: the K/V of the partition plus head_size * 4 + 8 bytes of output.
// Kernel 2, paged_attention_v2_reduce_kernel: grid (num_heads, num_seqs), kNumThreads threads. For
//   one (head, sequence) it reads the live partitions' max logits and exp sums, rescales each
//   partition by w_p = exp_sum_p * exp(max_p - max) and writes sum_p(w_p * tmp_out_p) / sum_p(w_p).
//   Dynamic shared memory: the max_num_partitions weights. Bytes: num_partitions * (head_size + 2)
//   * 4 read, head_size elements written; at 512-token partitions < 1% of kernel 1's K/V bytes.
//
// Workspace layouts (float32): exp_sums, max_logits [num_seqs, num_heads, max_num_partitions];
// tmp_out [num_seqs, num_heads, max_num_partitions, head_size]. Other layouts as in V1.
#include "dispatch_utils.cuh"
#include "ops.h"
#include "paged_attention.cuh"

namespace pagedllm {
namespace {

template <typename scalar_t, int HEAD_SIZE, int BLOCK_SIZE, int NUM_THREADS, int PARTITION_SIZE>
__global__ void __launch_bounds__(NUM_THREADS) paged_attention_v2_kernel(
    float* __restrict__ exp_sums,           // [num_seqs, num_heads, max_num_partitions]
    float* __restrict__ max_logits,         // [num_seqs, num_heads, max_num_partitions]
    float* __restrict__ tmp_out,            // [num_seqs, num_heads, max_num_partitions, head_size]
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
  paged_attention_kernel<scalar_t, float, HEAD_SIZE, BLOCK_SIZE, NUM_THREADS, PARTITION_SIZE>(
      exp_sums, max_logits, tmp_out, q, k_cache, v_cache, num_queries_per_kv, scale, block_tables, seq_lens,
      max_num_blocks_per_seq, alibi_slopes, q_stride, kv_block_stride, kv_head_stride);
}

template <typename scalar_t, int NUM_THREADS, int PARTITION_SIZE>
__global__ void __launch_bounds__(NUM_THREADS) paged_attention_v2_reduce_kernel(
    scalar_t* __restrict__ out,              // [num_seqs, num_heads, head_size]
    const float* __restrict__ exp_sums,      // [num_seqs, num_heads, max_num_partitions]
    const float* __restrict__ max_logits,    // [num_seqs, num_heads, max_num_partitions]
    const float* __restrict__ tmp_out,       // [num_seqs, num_heads, max_num_partitions, head_size]
    const int* __restrict__ seq_lens,        // [num_seqs]
    const int head_size,
    const int max_num_partitions) {
  constexpr int NUM_WARPS = NUM_THREADS / WARP_SIZE;
  const int head_idx = blockIdx.x;
  const int num_heads = gridDim.x;
  const int seq_idx = blockIdx.y;
  // Only the partitions kernel 1 wrote: the rest of the workspace is uninitialized.
  const int num_partitions = ceil_div(seq_lens[seq_idx], PARTITION_SIZE);
  const int64_t row = static_cast<int64_t>(seq_idx) * num_heads + head_idx;
  const float* max_logits_ptr = max_logits + row * max_num_partitions;
  const float* exp_sums_ptr = exp_sums + row * max_num_partitions;
  const float* tmp_out_ptr = tmp_out + row * max_num_partitions * head_size;

  extern __shared__ __align__(16) char shared_mem[];
  float* weights = reinterpret_cast<float*>(shared_mem);  // [max_num_partitions]
  __shared__ float red_smem[2 * NUM_WARPS];

  float max_logit = -FLT_MAX;
  for (int i = threadIdx.x; i < num_partitions; i += NUM_THREADS) {
    max_logit = fmaxf(max_logit, max_logits_ptr[i]);
  }
  max_logit = block_reduce<NUM_WARPS, 1>(red_smem, max_logit, MaxOp{}, -FLT_MAX);

  float global_exp_sum = 0.f;
  for (int i = threadIdx.x; i < num_partitions; i += NUM_THREADS) {
    const float weight = exp_sums_ptr[i] * __expf(max_logits_ptr[i] - max_logit);
    weights[i] = weight;
    global_exp_sum += weight;
  }
  // The sum's barrier also publishes `weights` to every thread.
  global_exp_sum = block_sum<NUM_WARPS>(&red_smem[NUM_WARPS], global_exp_sum);
  // >= 1: the partition holding the max has weight exp_sum >= 1.
  const float inv_global_exp_sum = __fdividef(1.f, global_exp_sum);

  scalar_t* out_ptr = out + row * head_size;
  for (int d = threadIdx.x; d < head_size; d += NUM_THREADS) {
    float acc = 0.f;
    for (int j = 0; j < num_partitions; j++) {
      acc += tmp_out_ptr[j * head_size + d] * weights[j];
    }
    from_float(out_ptr[d], acc * inv_global_exp_sum);
  }
}

template <typename scalar_t, int HEAD_SIZE, int BLOCK_SIZE>
void launch_v2(const PagedAttentionParams& p, const PartitionWorkspace& w, cudaStream_t stream) {
  const dim3 grid(p.num_heads, p.num_seqs, w.max_num_partitions);
  const int shared_mem_size = attention_shared_mem_bytes<HEAD_SIZE, kNumThreads>(kPartitionSize);
  paged_attention_v2_kernel<scalar_t, HEAD_SIZE, BLOCK_SIZE, kNumThreads, kPartitionSize>
      <<<grid, kNumThreads, shared_mem_size, stream>>>(
          w.exp_sums, w.max_logits, w.tmp_out, static_cast<const scalar_t*>(p.query),
          static_cast<const scalar_t*>(p.key_cache), static_cast<const scalar_t*>(p.value_cache),
          p.num_heads / p.num_kv_heads, p.scale, p.block_tables, p.seq_lens, p.max_num_blocks_per_seq,
          p.alibi_slopes, p.q_stride, p.kv_block_stride, p.kv_head_stride);
  check_cuda(cudaGetLastError(), "paged_attention_v2 launch");
}

template <typename scalar_t>
void launch_v2_reduce(const PagedAttentionParams& p, const PartitionWorkspace& w, cudaStream_t stream) {
  const dim3 grid(p.num_heads, p.num_seqs);
  const int shared_mem_size = w.max_num_partitions * static_cast<int>(sizeof(float));
  paged_attention_v2_reduce_kernel<scalar_t, kNumThreads, kPartitionSize>
      <<<grid, kNumThreads, shared_mem_size, stream>>>(static_cast<scalar_t*>(p.out), w.exp_sums, w.max_logits,
                                                       w.tmp_out, p.seq_lens, p.head_size, w.max_num_partitions);
  check_cuda(cudaGetLastError(), "paged_attention_v2 reduce launch");
}

}  // namespace

void paged_attention_v2(const PagedAttentionParams& params, const PartitionWorkspace& workspace,
                        cudaStream_t stream) {
  dispatch_scalar_type(params.dtype, [&](auto scalar_tag) {
    using scalar_t = typename decltype(scalar_tag)::type;
    dispatch_head_size(params.head_size, [&](auto head_size) {
      dispatch_block_size(params.block_size, [&](auto block_size) {
        launch_v2<scalar_t, decltype(head_size)::value, decltype(block_size)::value>(params, workspace, stream);
      });
    });
    launch_v2_reduce<scalar_t>(params, workspace, stream);
  });
}

}  // namespace pagedllm
