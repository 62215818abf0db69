// PagedAttention for decode: the attention of one new query token per sequence over its paged K/V
// cache. This is the body both launchers share: V1 (paged_attention_v1.cu, vLLM's kernel and
// vLLM's single_query_cached_kv_attention) runs it over the whole context, V2
// (paged_attention_v2.cu, vLLM's design) over one partition of PARTITION_SIZE tokens.
//
// Grid (num_heads, num_seqs, num_partitions), NUM_THREADS threads = NUM_WARPS warps per block; V1
// has one partition. A thread block computes one query head of one sequence over its partition:
//
//   1. Q in registers. The warp is cut into BLOCK_SIZE thread groups of THREAD_GROUP_SIZE =
//      WARP_SIZE / BLOCK_SIZE threads; each thread keeps every THREAD_GROUP_SIZE-th VEC_SIZE-wide
//      piece of the query, so a thread group holds the whole query and reads 16 bytes per step.
//   2. QK^T. Each warp takes one cache block at a time (blocks warp_idx, warp_idx + NUM_WARPS, ...);
//      thread group g of the warp takes token g of the block, loads its key piece by piece (the
//      same pieces as its query), and Qk_dot sums the products over the group with shuffles. The
//      group's first thread writes the scaled logit (+ ALiBi bias) to `logits` in shared memory
//      and keeps the running max.
//   3. Softmax. Block-wide max (butterfly within each warp, then across warps through red_smem),
//      exp(logit - max) in place, block-wide sum, normalization. V2 also stores the partition's
//      max and sum for the reduce kernel.
//   4. P V. Each warp again takes one block at a time; NUM_V_VECS_PER_ROW lanes share a row of the
//      block's V (one head dimension, BLOCK_SIZE tokens), each loading V_VEC_SIZE tokens of it (16
//      bytes) against the same tokens' probabilities. Every thread accumulates NUM_ROWS_PER_THREAD
//      rows in float; the lanes of a row are summed with shuffles.
//   5. Cross-warp reduction. Warps hold partial sums over different blocks: the upper half of the
//      warps writes to shared memory (reusing `logits`), the lower half adds, halving until warp 0
//      holds the row; warp 0 writes the output (V2: the partition's normalized output, in float).
//
// Layouts (x = 16 / sizeof(scalar_t) elements, 16 bytes):
//   q         [num_seqs, num_heads, head_size], token stride q_stride
//   k_cache   [num_blocks, num_kv_heads, head_size / x, block_size, x]: the x-element pieces of a
//             token's key are block_size * x apart, and the BLOCK_SIZE thread groups of a warp read
//             the same piece of BLOCK_SIZE consecutive tokens, i.e. one contiguous, coalesced run.
//   v_cache   [num_blocks, num_kv_heads, head_size, block_size]: a row (one head dimension, all
//             tokens of the block) is contiguous, so a lane reads V_VEC_SIZE tokens' values at once.
//   block_tables [num_seqs, max_num_blocks_per_seq], seq_lens [num_seqs] (vLLM's original context_lens).
//   out       [num_seqs, num_heads, num_partitions, head_size] (V1: num_partitions = 1).
// Both caches have block strides kv_block_stride and KV-head strides kv_head_stride. GQA/MQA: query
// head h reads KV head h / num_queries_per_kv (vLLM's original head_mapping, as arithmetic: heads of one
// KV group are adjacent, as Llama-family checkpoints lay them out).
//
// Bound: memory. Each block reads seq_len * head_size * sizeof(scalar_t) bytes of K and as many of
// V, and does 4 * seq_len * head_size FLOPs (~1 FLOP per byte at 16 bits). A KV head is read once
// per query head of its group: the GQA re-read of vLLM's original V1 kernel (the Triton backend's decode
// kernel reads it once per group instead).
#pragma once

#include <cfloat>
#include <cstdint>

#include "dispatch_utils.cuh"
#include "dtype_utils.cuh"
#include "reduction_utils.cuh"

namespace pagedllm {

// Q . K over a thread group: each thread multiplies its N pieces lane by lane (VEC_SIZE
// independent FMA chains, vLLM's original mul/fma on the float vector), sums the lanes, then the group
// sums across its threads; every thread of the group returns the full dot product.
template <int THREAD_GROUP_SIZE, typename T, int VEC_SIZE, int N>
__device__ __forceinline__ float qk_dot(const Vec<T, VEC_SIZE> (&q)[N], const Vec<T, VEC_SIZE> (&k)[N]) {
  float lanes[VEC_SIZE];
#pragma unroll
  for (int l = 0; l < VEC_SIZE; l++) {
    lanes[l] = to_float(q[0].data[l]) * to_float(k[0].data[l]);
  }
#pragma unroll
  for (int i = 1; i < N; i++) {
#pragma unroll
    for (int l = 0; l < VEC_SIZE; l++) {
      lanes[l] = fmaf(to_float(q[i].data[l]), to_float(k[i].data[l]), lanes[l]);
    }
  }
  float qk = 0.f;
#pragma unroll
  for (int l = 0; l < VEC_SIZE; l++) {
    qk += lanes[l];
  }
#pragma unroll
  for (int mask = THREAD_GROUP_SIZE / 2; mask >= 1; mask /= 2) {
    qk += __shfl_xor_sync(0xffffffffu, qk, mask);
  }
  return qk;
}

// Dynamic shared memory of one thread block: the logits of the tokens it covers (V1: the longest
// sequence, rounded up to whole blocks; V2: one partition), reused by the cross-warp reduction.
template <int HEAD_SIZE, int NUM_THREADS>
constexpr int attention_shared_mem_bytes(int num_tokens) {
  constexpr int out_floats = (NUM_THREADS / WARP_SIZE / 2) * HEAD_SIZE;
  return static_cast<int>(sizeof(float)) * (num_tokens > out_floats ? num_tokens : out_floats);
}

// PARTITION_SIZE = 0: V1, the whole context, `out` of scalar_t, exp_sums/max_logits unused.
// PARTITION_SIZE > 0: V2, partition blockIdx.z, `out` is the float tmp_out.
template <typename scalar_t, typename out_t, int HEAD_SIZE, int BLOCK_SIZE, int NUM_THREADS, int PARTITION_SIZE>
__device__ __forceinline__ void paged_attention_kernel(
    float* __restrict__ exp_sums,             // [num_seqs, num_heads, num_partitions]
    float* __restrict__ max_logits,           // [num_seqs, num_heads, num_partitions]
    out_t* __restrict__ out,                  // [num_seqs, num_heads, num_partitions, head_size]
    const scalar_t* __restrict__ q,           // [num_seqs, num_heads, head_size]
    const scalar_t* __restrict__ k_cache,     // [num_blocks, num_kv_heads, head_size/x, block_size, x]
    const scalar_t* __restrict__ v_cache,     // [num_blocks, num_kv_heads, head_size, block_size]
    const int num_queries_per_kv,
    const float scale,
    const int* __restrict__ block_tables,     // [num_seqs, max_num_blocks_per_seq]
    const int* __restrict__ seq_lens,         // [num_seqs]
    const int max_num_blocks_per_seq,
    const float* __restrict__ alibi_slopes,   // [num_heads] or nullptr
    const int q_stride,
    const int kv_block_stride,
    const int kv_head_stride) {
  // With blocks of at most a warp's size each thread group owns exactly one token of its warp's
  // block (vLLM's original NUM_TOKENS_PER_THREAD_GROUP is 1 for every block size built here).
  static_assert(BLOCK_SIZE <= WARP_SIZE && WARP_SIZE % BLOCK_SIZE == 0, "block size must divide the warp");
  static_assert(NUM_THREADS % WARP_SIZE == 0, "whole warps");
  constexpr bool USE_PARTITIONING = PARTITION_SIZE > 0;
  static_assert(PARTITION_SIZE % BLOCK_SIZE == 0, "partitions are whole cache blocks");
  constexpr int THREAD_GROUP_SIZE = WARP_SIZE / BLOCK_SIZE;
  constexpr int NUM_WARPS = NUM_THREADS / WARP_SIZE;
  const int thread_idx = threadIdx.x;
  const int warp_idx = thread_idx / WARP_SIZE;
  const int lane = thread_idx % WARP_SIZE;

  const int head_idx = blockIdx.x;
  const int num_heads = gridDim.x;
  const int seq_idx = blockIdx.y;
  const int partition_idx = blockIdx.z;
  const int num_partitions = gridDim.z;
  const int seq_len = seq_lens[seq_idx];
  // The V2 grid is sized for the longest sequence: the partitions past this one's end have no
  // tokens (the whole block returns, so no barrier is left waiting).
  if (USE_PARTITIONING && partition_idx * PARTITION_SIZE >= seq_len) {
    return;
  }
  const int num_seq_blocks = ceil_div(seq_len, BLOCK_SIZE);
  const int num_blocks_per_partition = USE_PARTITIONING ? PARTITION_SIZE / BLOCK_SIZE : num_seq_blocks;
  const int start_block_idx = partition_idx * num_blocks_per_partition;
  const int end_block_idx = min(start_block_idx + num_blocks_per_partition, num_seq_blocks);
  const int start_token_idx = start_block_idx * BLOCK_SIZE;
  const int num_tokens = min(end_block_idx * BLOCK_SIZE, seq_len) - start_token_idx;

  const int kv_head_idx = head_idx / num_queries_per_kv;
  const float alibi_slope = alibi_slopes == nullptr ? 0.f : alibi_slopes[head_idx];

  // A thread group reads 16 bytes of a key (or query) at a time: VEC_SIZE elements per thread.
  constexpr int VEC_SIZE = 16 / (THREAD_GROUP_SIZE * sizeof(scalar_t)) > 0
                               ? 16 / (THREAD_GROUP_SIZE * sizeof(scalar_t))
                               : 1;
  using K_vec = Vec<scalar_t, VEC_SIZE>;
  using Q_vec = Vec<scalar_t, VEC_SIZE>;
  constexpr int NUM_ELEMS_PER_THREAD = HEAD_SIZE / THREAD_GROUP_SIZE;
  constexpr int NUM_VECS_PER_THREAD = NUM_ELEMS_PER_THREAD / VEC_SIZE;
  // The cache's x: one thread group's 16-byte step is exactly one contiguous x-element piece.
  constexpr int x = 16 / sizeof(scalar_t);
  static_assert(THREAD_GROUP_SIZE * VEC_SIZE == x, "a thread group step is one x-element piece");
  static_assert(HEAD_SIZE % x == 0, "head size must be whole 16-byte pieces");
  const int thread_group_idx = thread_idx / THREAD_GROUP_SIZE;
  const int thread_group_offset = thread_idx % THREAD_GROUP_SIZE;

  // 1. The query in registers: thread t of a group holds pieces t, t + THREAD_GROUP_SIZE, ...
  const scalar_t* q_ptr = q + seq_idx * q_stride + head_idx * HEAD_SIZE;
  Q_vec q_vecs[NUM_VECS_PER_THREAD];
#pragma unroll
  for (int i = 0; i < NUM_VECS_PER_THREAD; i++) {
    const int vec_idx = thread_group_offset + i * THREAD_GROUP_SIZE;
    q_vecs[i] = *reinterpret_cast<const Q_vec*>(q_ptr + vec_idx * VEC_SIZE);
  }

  // float logits for the softmax's accuracy; 16-byte aligned for the float vectors of step 4.
  extern __shared__ __align__(16) char shared_mem[];
  float* logits = reinterpret_cast<float*>(shared_mem);
  // Two slices, one per block reduction (max, then sum), so the second needs no extra barrier.
  __shared__ float red_smem[2 * NUM_WARPS];

  // 2. QK^T, one cache block per warp per iteration, one token per thread group.
  const int* block_table = block_tables + seq_idx * max_num_blocks_per_seq;
  const int physical_block_offset = thread_group_idx % BLOCK_SIZE;
  float qk_max = -FLT_MAX;
  for (int block_idx = start_block_idx + warp_idx; block_idx < end_block_idx; block_idx += NUM_WARPS) {
    // int64: block * stride passes 2^31 elements in caches of a few GB.
    const int64_t physical_block_number = block_table[block_idx];
    const int token_idx = block_idx * BLOCK_SIZE + physical_block_offset;
    const scalar_t* k_ptr = k_cache + physical_block_number * kv_block_stride + kv_head_idx * kv_head_stride +
                            physical_block_offset * x;
    K_vec k_vecs[NUM_VECS_PER_THREAD];
#pragma unroll
    for (int j = 0; j < NUM_VECS_PER_THREAD; j++) {
      // Piece vec_idx starts at element vec_idx * VEC_SIZE = j * x + thread_group_offset * VEC_SIZE
      // (THREAD_GROUP_SIZE * VEC_SIZE == x): it is x-piece offset1 = j of the key, at offset2 =
      // thread_group_offset * VEC_SIZE within it. Written this way every load is one base
      // register plus a compile-time offset, instead of a per-piece address kept in registers.
      const int offset1 = j;
      const int offset2 = thread_group_offset * VEC_SIZE;
      k_vecs[j] = *reinterpret_cast<const K_vec*>(k_ptr + offset1 * BLOCK_SIZE * x + offset2);
    }
    // ALiBi: slope * (key position - query position), the query being token seq_len - 1.
    const float qk = scale * qk_dot<THREAD_GROUP_SIZE>(q_vecs, k_vecs) + alibi_slope * (token_idx - seq_len + 1);
    if (thread_group_offset == 0) {
      // Slots past seq_len in the last block hold stale values: their logits must be exactly 0
      // after the softmax (they meet V in step 4), and they must not move the max.
      const bool mask = token_idx >= seq_len;
      logits[token_idx - start_token_idx] = mask ? 0.f : qk;
      qk_max = mask ? qk_max : fmaxf(qk_max, qk);
    }
  }

  // 3. Softmax. Only the groups' first lanes hold maxima: the warp butterfly stops at
  // THREAD_GROUP_SIZE. The reduction's barrier also makes every logit visible to every thread.
  qk_max = block_reduce<NUM_WARPS, THREAD_GROUP_SIZE>(red_smem, qk_max, MaxOp{}, -FLT_MAX);
  float exp_sum = 0.f;
  for (int i = thread_idx; i < num_tokens; i += NUM_THREADS) {
    const float val = __expf(logits[i] - qk_max);
    logits[i] = val;
    exp_sum += val;
  }
  exp_sum = block_sum<NUM_WARPS>(&red_smem[NUM_WARPS], exp_sum);
  // exp_sum >= 1 (the max logit contributes exp(0)): no epsilon is needed against a zero.
  const float inv_sum = __fdividef(1.f, exp_sum);
  for (int i = thread_idx; i < num_tokens; i += NUM_THREADS) {
    logits[i] *= inv_sum;
  }
  __syncthreads();
  if (USE_PARTITIONING && thread_idx == 0) {
    const int64_t offset = (static_cast<int64_t>(seq_idx) * num_heads + head_idx) * num_partitions + partition_idx;
    max_logits[offset] = qk_max;
    exp_sums[offset] = exp_sum;
  }

  // 4. P V. A row is one head dimension of a block: NUM_V_VECS_PER_ROW lanes split its tokens.
  constexpr int V_VEC_SIZE = 16 / sizeof(scalar_t) < BLOCK_SIZE ? 16 / sizeof(scalar_t) : BLOCK_SIZE;
  using V_vec = Vec<scalar_t, V_VEC_SIZE>;
  using Float_L_vec = Vec<float, V_VEC_SIZE>;
  constexpr int NUM_V_VECS_PER_ROW = BLOCK_SIZE / V_VEC_SIZE;
  constexpr int NUM_ROWS_PER_ITER = WARP_SIZE / NUM_V_VECS_PER_ROW;
  constexpr int NUM_ROWS_PER_THREAD = ceil_div(HEAD_SIZE, NUM_ROWS_PER_ITER);
  float accs[NUM_ROWS_PER_THREAD];
#pragma unroll
  for (int i = 0; i < NUM_ROWS_PER_THREAD; i++) {
    accs[i] = 0.f;
  }
  const int v_token_offset = (lane % NUM_V_VECS_PER_ROW) * V_VEC_SIZE;
  for (int block_idx = start_block_idx + warp_idx; block_idx < end_block_idx; block_idx += NUM_WARPS) {
    const int64_t physical_block_number = block_table[block_idx];
    const int token_idx = block_idx * BLOCK_SIZE + v_token_offset;
    const Float_L_vec logits_vec = *reinterpret_cast<const Float_L_vec*>(logits + token_idx - start_token_idx);
    const scalar_t* v_ptr = v_cache + physical_block_number * kv_block_stride + kv_head_idx * kv_head_stride;
    // Probabilities past seq_len are 0, but the values there may be anything (NaN in an
    // uninitialized cache) and 0 * NaN is NaN: zero those values in the sequence's last block.
    const bool is_last_block = block_idx == num_seq_blocks - 1;
#pragma unroll
    for (int i = 0; i < NUM_ROWS_PER_THREAD; i++) {
      const int row_idx = lane / NUM_V_VECS_PER_ROW + i * NUM_ROWS_PER_ITER;
      if (row_idx < HEAD_SIZE) {
        V_vec v_vec = *reinterpret_cast<const V_vec*>(v_ptr + row_idx * BLOCK_SIZE + v_token_offset);
        if (is_last_block) {
#pragma unroll
          for (int j = 0; j < V_VEC_SIZE; j++) {
            if (token_idx + j >= seq_len) {
              from_float(v_vec.data[j], 0.f);
            }
          }
        }
        accs[i] += dot(logits_vec, v_vec);
      }
    }
  }
#pragma unroll
  for (int i = 0; i < NUM_ROWS_PER_THREAD; i++) {
    float acc = accs[i];
#pragma unroll
    for (int mask = NUM_V_VECS_PER_ROW / 2; mask >= 1; mask /= 2) {
      acc += __shfl_xor_sync(0xffffffffu, acc, mask);
    }
    accs[i] = acc;
  }
  // The logits' shared memory is reused below: every warp must be done reading it.
  __syncthreads();

  // 5. Cross-warp reduction: warps [mid, i) hand their rows to warps [0, mid), halving each round.
  float* out_smem = reinterpret_cast<float*>(shared_mem);
#pragma unroll
  for (int i = NUM_WARPS; i > 1; i /= 2) {
    const int mid = i / 2;
    if (warp_idx >= mid && warp_idx < i) {
      float* dst = &out_smem[(warp_idx - mid) * HEAD_SIZE];
#pragma unroll
      for (int r = 0; r < NUM_ROWS_PER_THREAD; r++) {
        const int row_idx = lane / NUM_V_VECS_PER_ROW + r * NUM_ROWS_PER_ITER;
        if (row_idx < HEAD_SIZE && lane % NUM_V_VECS_PER_ROW == 0) {
          dst[row_idx] = accs[r];
        }
      }
    }
    __syncthreads();
    if (warp_idx < mid) {
      const float* src = &out_smem[warp_idx * HEAD_SIZE];
#pragma unroll
      for (int r = 0; r < NUM_ROWS_PER_THREAD; r++) {
        const int row_idx = lane / NUM_V_VECS_PER_ROW + r * NUM_ROWS_PER_ITER;
        if (row_idx < HEAD_SIZE && lane % NUM_V_VECS_PER_ROW == 0) {
          accs[r] += src[row_idx];
        }
      }
    }
    __syncthreads();
  }

  if (warp_idx == 0) {
    out_t* out_ptr =
        out + ((static_cast<int64_t>(seq_idx) * num_heads + head_idx) * num_partitions + partition_idx) * HEAD_SIZE;
#pragma unroll
    for (int r = 0; r < NUM_ROWS_PER_THREAD; r++) {
      const int row_idx = lane / NUM_V_VECS_PER_ROW + r * NUM_ROWS_PER_ITER;
      if (row_idx < HEAD_SIZE && lane % NUM_V_VECS_PER_ROW == 0) {
        from_float(out_ptr[row_idx], accs[r]);
      }
    }
  }
}

}  // namespace pagedllm
