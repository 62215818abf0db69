// Paged attention on the CPU: every query token of a step attends over its sequence's context,
// read in place from the paged KV cache (no gathered copy, no mask tensor).
//
// Grid: at::parallel_for over work items, split into contiguous ranges, one per thread of torch's
// intra-op pool. An item is one query token and a range of KV heads: all of them when the step has
// at least 4 tokens a thread (each key's rows for every head are then one contiguous read, and a
// block's keys follow each other, which the hardware prefetchers stream), else one head, so that
// a lone decode still spreads over the threads. For each KV head the item computes the `group =
// num_heads / num_kv_heads` query heads that share it, so every K and V row is converted to
// float32 once for the whole group (GQA needs no K/V expansion).
//
// What an item does: its query sits at position `pos = seq_len - query_len + i` and sees keys
// `lo <= j <= pos` (`lo = pos - sliding_window + 1` with a window, else 0). It walks them in tiles
// of kTileKeys with the online softmax of FlashAttention (Dao et al., 2022): a tile's scores
// `scale * q . k_j` (then the soft cap, then ALiBi's `slope * (j - pos)`), the running maximum and
// sum rescaled once per tile, `acc += exp(s - max) * v_j`; at the end `out = acc / sum`. All
// arithmetic is float32, whatever the cache's dtype. bf16 with head size 64 or 128, no soft cap
// and no ALiBi takes the AVX512-BF16 path (attend_head_bf16) where the CPU has the instructions:
// the same algorithm with tiles of 16 keys, one KV head at a time.
//
// Layouts: query, out [num_tokens, num_heads, head_size], head rows contiguous (the token stride
// is free: the model's fused QKV output is a strided view); key/value caches [num_blocks,
// block_size, num_kv_heads, head_size] contiguous, so one key of one KV head is head_size
// contiguous elements; block_tables [num_seqs, max_blocks_per_seq] int32; seq_lens [num_seqs] and
// query_start_loc [num_seqs + 1] int32. Tokens past query_start_loc[num_seqs] (padding, or
// sequences the caller left out of the metadata it passed) are not written.
//
// Bound: a decode item reads 2 * ctx * head_size cache elements a KV head and does 4 * group *
// ctx * head_size FLOPs: at group 3 in bf16, 3 FLOPs a byte read. Within a model's step the cache
// is cold (the layers' weights stream through the caches in between), so misses set the pace
// once the arithmetic is lean. C1's decode layer (32 sequences of ~100 tokens, 3 KV heads of 64,
// 2.4 MB of K and V; benchmarks/cpu_kernels.py, two cores): the generic loop took 194 us warm and
// 402 us cold, the AVX512-BF16 path 81 us and 176 us (~100 us in the engine's step). Items of
// single heads, reading 128 B of every 384 B row, took ~0.55 ms cold; whole rows with a tile's
// prefetches issued at once (they wait for free miss buffers) ~0.3 ms; each key's rows are now
// prefetched a few keys ahead, spread over the arithmetic.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "ops.h"
#include "vec_math.h"

namespace pagedllm_cpu {

namespace {

constexpr int64_t kTileKeys = 32;
constexpr int64_t kPrefetchKeys = 8;

#if defined(__AVX512BF16__)
// bf16 caches on CPUs with AVX512-BF16 (Zen 4 and later, Cooper Lake, Sapphire Rapids): one KV
// head's rows at a time, its group of query rows together, in registers.
//
// Scores: a tile of 16 keys. q . k_j is VDPBF16PS over the head's bf16 pairs (products exact in
// float32, summed in float32), one 16-lane partial vector per key; sum_lanes16 folds the 16
// vectors into one whose lane j is key j's score (45 shuffles and adds for 16 keys, against a
// horizontal reduction per key). Softmax: vectors of 16 scores, exp_approx's polynomial. Values:
// each row converted to float32 once (a bf16 is the top half of a float) and accumulated with
// FMAs into R x 2C registers. The generic loop below converts every K and V row to a float buffer,
// reduces each dot product horizontally and keeps its accumulators in memory: ~3x the
// instructions a key.
constexpr int kLanes = 16;

// Lane j of the result is the sum of the 16 lanes of v[j].
inline __m512 sum_lanes16(const __m512* v) {
  __m512 pairs[8], quads[4];
  for (int i = 0; i < 8; ++i) {  // per 128-bit chunk: [a0 + a2, b0 + b2, a1 + a3, b1 + b3]
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {  // per 128-bit chunk: the chunk's sums of keys 4i ... 4i + 3
    const __m512d x = _mm512_castps_pd(pairs[2 * i]), y = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  // The four chunks of each quads[i] added: chunk i of the result.
  const __m512 lo = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x88), _mm512_shuffle_f32x4(quads[0], quads[1], 0xDD));
  const __m512 hi = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x88), _mm512_shuffle_f32x4(quads[2], quads[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(lo, hi, 0x88), _mm512_shuffle_f32x4(lo, hi, 0xDD));
}

// exp_approx (vec_math.h), 16 lanes at a time: the same clamps, rounding and polynomial.
inline __m512 exp_approx16(__m512 x) {
  const __m512 t = _mm512_min_ps(_mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(1.4426950408889634f)),
                                 _mm512_set1_ps(128.f));
  const __m512 magic = _mm512_set1_ps(12582912.f);
  const __m512 n = _mm512_sub_ps(_mm512_add_ps(t, magic), magic);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.6931471805599453f));
  __m512 p = _mm512_set1_ps(1.f / 720);
  for (const float c : {1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

inline __m512 bf16_to_float(const c10::BFloat16* src) {  // 16 elements
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

inline void prefetch_rows(const c10::BFloat16* row, int64_t bytes) {
  for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch(reinterpret_cast<const char*>(row) + line, _MM_HINT_T0);
}

// Rows [0, R) of one KV head's group: queries q (row r at q + r * head_size, bf16) over keys
// lo..pos, written to out (same layout). C: head_size / 32, bf16 pairs vectors a row. Keys are
// prefetched a tile ahead and values a tile's softmax ahead, prefetch_bytes from
// prefetch_offset elements past the head's row (the first head of an item asks for every head's
// rows, a key's whole contiguous span; none when 0).
template <int R, int C>
void attend_head_bf16(const c10::BFloat16* q, c10::BFloat16* out, const c10::BFloat16* k_base,
                      const c10::BFloat16* v_base, const int32_t* table, int64_t block_size, int64_t row_stride,
                      int64_t head_offset, int64_t lo, int64_t pos, float scale, int64_t prefetch_offset,
                      int64_t prefetch_bytes) {
  constexpr int64_t head_size = 32 * C;
  __m512bh qv[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) qv[r][c] = (__m512bh)_mm512_loadu_si512(q + r * head_size + 32 * c);
  __m512 acc[R][2 * C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 2 * C; ++c) acc[r][c] = _mm512_setzero_ps();
  float row_max[R], row_sum[R];
  alignas(64) float probs[R][kLanes];
  for (int r = 0; r < R; ++r) {
    row_max[r] = -std::numeric_limits<float>::infinity();
    row_sum[r] = 0.f;
  }
  auto row_of = [&](const c10::BFloat16* cache, int64_t j) {
    return cache + (static_cast<int64_t>(table[j / block_size]) * block_size + j % block_size) * row_stride + head_offset;
  };
  const c10::BFloat16* keys[kLanes];
  if (prefetch_bytes > 0) {
    for (int64_t j = lo; j < std::min(lo + kLanes, pos + 1); ++j) prefetch_rows(row_of(k_base, j) + prefetch_offset, prefetch_bytes);
  }
  for (int64_t tile = lo; tile <= pos; tile += kLanes) {
    const int n = static_cast<int>(std::min<int64_t>(kLanes, pos + 1 - tile));
    for (int j = 0; j < n; ++j) keys[j] = row_of(k_base, tile + j);
    const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1u);
    for (int r = 0; r < R; ++r) {
      __m512 partial[kLanes];
      for (int j = 0; j < kLanes; ++j) {
        if (r == 0 && prefetch_bytes > 0) {  // the next tile's keys, this tile's values
          if (tile + kLanes + j <= pos) prefetch_rows(row_of(k_base, tile + kLanes + j) + prefetch_offset, prefetch_bytes);
          if (j < n) prefetch_rows(row_of(v_base, tile + j) + prefetch_offset, prefetch_bytes);
        }
        partial[j] = _mm512_setzero_ps();
        if (j < n) {
          for (int c = 0; c < C; ++c) {
            partial[j] = _mm512_dpbf16_ps(partial[j], qv[r][c], (__m512bh)_mm512_loadu_si512(keys[j] + 32 * c));
          }
        }
      }
      const __m512 scores = _mm512_mask_mov_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), valid,
                                               _mm512_mul_ps(sum_lanes16(partial), _mm512_set1_ps(scale)));
      const float tile_max = std::max(row_max[r], _mm512_reduce_max_ps(scores));
      const float rescale = exp_approx(row_max[r] - tile_max);  // 0 on the first tile
      row_max[r] = tile_max;
      const __m512 p = _mm512_maskz_mov_ps(valid, exp_approx16(_mm512_sub_ps(scores, _mm512_set1_ps(tile_max))));
      row_sum[r] = row_sum[r] * rescale + _mm512_reduce_add_ps(p);
      _mm512_store_ps(probs[r], p);
      for (int c = 0; c < 2 * C; ++c) acc[r][c] = _mm512_mul_ps(acc[r][c], _mm512_set1_ps(rescale));
    }
    for (int j = 0; j < n; ++j) {
      const c10::BFloat16* v = row_of(v_base, tile + j);
      __m512 vf[2 * C];
      for (int c = 0; c < 2 * C; ++c) vf[c] = bf16_to_float(v + 16 * c);
      for (int r = 0; r < R; ++r) {
        const __m512 pj = _mm512_set1_ps(probs[r][j]);
        for (int c = 0; c < 2 * C; ++c) acc[r][c] = _mm512_fmadd_ps(pj, vf[c], acc[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m512 inv = _mm512_set1_ps(1.f / row_sum[r]);
    for (int c = 0; c < 2 * C; ++c) {
      const __m256bh o = _mm512_cvtneps_pbh(_mm512_mul_ps(acc[r][c], inv));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * head_size + 16 * c), (__m256i)o);
    }
  }
}

// One KV head's `group` query rows, in chunks of at most 4 rows (R x 2C float accumulators).
template <int C>
void attend_group_bf16(const c10::BFloat16* q, c10::BFloat16* out, int64_t group, const c10::BFloat16* k_base,
                       const c10::BFloat16* v_base, const int32_t* table, int64_t block_size, int64_t row_stride,
                       int64_t head_offset, int64_t lo, int64_t pos, float scale, int64_t prefetch_offset,
                       int64_t prefetch_bytes) {
  constexpr int64_t head_size = 32 * C;
  for (int64_t r0 = 0; r0 < group; r0 += 4) {
    const auto* qr = q + r0 * head_size;
    auto* outr = out + r0 * head_size;
    const auto attend = std::array{attend_head_bf16<1, C>, attend_head_bf16<2, C>, attend_head_bf16<3, C>,
                                   attend_head_bf16<4, C>}[std::min<int64_t>(4, group - r0) - 1];
    attend(qr, outr, k_base, v_base, table, block_size, row_stride, head_offset, lo, pos, scale, prefetch_offset,
           r0 == 0 ? prefetch_bytes : 0);
  }
}
#endif

template <typename scalar_t>
void paged_attention_impl(
    const at::Tensor& out,
    const at::Tensor& query,
    const at::Tensor& key_cache,
    const at::Tensor& value_cache,
    const at::Tensor& block_tables,
    const at::Tensor& seq_lens,
    const at::Tensor& query_start_loc,
    double scale,
    int64_t sliding_window,
    double logits_soft_cap,
    const float* alibi_slopes) {
  const int64_t num_seqs = seq_lens.size(0);
  const int64_t num_heads = query.size(1), head_size = query.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  const int64_t q_stride = query.stride(0), out_stride = out.stride(0);
  const int64_t row_stride = num_kv_heads * head_size;  // between two slots of a cache

  const scalar_t* q_base = query.const_data_ptr<scalar_t>();
  scalar_t* out_base = out.mutable_data_ptr<scalar_t>();
  const scalar_t* k_base = key_cache.const_data_ptr<scalar_t>();
  const scalar_t* v_base = value_cache.const_data_ptr<scalar_t>();
  const int32_t* tables = block_tables.const_data_ptr<int32_t>();
  const int32_t* lens = seq_lens.const_data_ptr<int32_t>();
  const int32_t* starts = query_start_loc.const_data_ptr<int32_t>();

  // The tokens to compute and their sequences, so that work items split evenly over threads.
  std::vector<int32_t> tokens, token_seq;
  tokens.reserve(starts[num_seqs]);
  token_seq.reserve(starts[num_seqs]);
  for (int32_t s = 0; s < num_seqs; ++s) {
    for (int32_t t = starts[s]; t < starts[s + 1]; ++t) {
      tokens.push_back(t);
      token_seq.push_back(s);
    }
  }
  const int64_t num_tokens = static_cast<int64_t>(tokens.size());
  const float fscale = static_cast<float>(scale);
  const float cap = static_cast<float>(logits_soft_cap);

  // A work item is one token and a range of KV heads: all of them when there are tokens enough to
  // share among the threads (a key's rows for every head are then one contiguous read, and a
  // block's keys follow each other in memory), else one head, so a lone decode still spreads.
  const int64_t heads_per_item = num_tokens >= 4 * at::get_num_threads() ? num_kv_heads : 1;
  const int64_t items_per_token = num_kv_heads / heads_per_item;
  const int64_t rows = heads_per_item * group;  // query heads per item
  const int64_t span = heads_per_item * head_size;  // elements of one key's rows for the item
  const int64_t span_bytes = span * static_cast<int64_t>(sizeof(scalar_t));
  // The AVX512-BF16 path: head sizes of 64 and 128, scores without soft cap or ALiBi.
  [[maybe_unused]] const bool fast = (head_size == 64 || head_size == 128) && cap == 0.f && alibi_slopes == nullptr;

  at::parallel_for(0, num_tokens * items_per_token, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> workspace(rows * (2 * head_size + kTileKeys + 2) + span);
    float* q = workspace.data();  // [rows, head_size]
    float* acc = q + rows * head_size;  // [rows, head_size]
    float* scores = acc + rows * head_size;  // [rows, kTileKeys]
    float* row_max = scores + rows * kTileKeys;  // [rows]
    float* row_sum = row_max + rows;  // [rows]
    float* kv = row_sum + rows;  // [span]: one key's (or value's) rows, in float
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = tokens[item / items_per_token], s = token_seq[item / items_per_token];
      const int64_t h0 = (item % items_per_token) * heads_per_item;
      const int64_t query_len = starts[s + 1] - starts[s];
      const int64_t pos = lens[s] - query_len + (t - starts[s]);
      const int64_t lo = sliding_window > 0 ? std::max<int64_t>(0, pos - sliding_window + 1) : 0;
      const int32_t* table = tables + s * max_blocks;
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
        if (fast) {
          for (int64_t h = h0; h < h0 + heads_per_item; ++h) {
            const int64_t offset = h * group * head_size;
            const auto attend = head_size == 64 ? attend_group_bf16<2> : attend_group_bf16<4>;
            attend(q_base + t * q_stride + offset, out_base + t * out_stride + offset, group, k_base, v_base, table,
                   block_size, row_stride, h * head_size, lo, pos, fscale, (h0 - h) * head_size,
                   h == h0 ? span_bytes : 0);
          }
          continue;
        }
      }
#endif
      // Query heads h0 * group ... are contiguous in the query: row r is query head h0 * group + r.
      to_float(q_base + t * q_stride + h0 * group * head_size, q, rows * head_size);
      std::fill(acc, acc + rows * head_size, 0.f);
      std::fill(row_max, row_max + rows, -std::numeric_limits<float>::infinity());
      std::fill(row_sum, row_sum + rows, 0.f);
      auto rows_of = [&](const scalar_t* cache, int64_t j) {  // key j's rows for heads h0...
        return cache + (static_cast<int64_t>(table[j / block_size]) * block_size + j % block_size) * row_stride +
            h0 * head_size;
      };
      // Keys lie wherever their blocks do, which the hardware prefetchers cannot guess: each step
      // asks for the rows kPrefetchKeys keys ahead, so that misses overlap the arithmetic (a burst
      // of a whole tile's prefetches would only wait for free miss buffers).
      auto prefetch = [&](const scalar_t* cache, int64_t j) {
        if (j > pos) return;
        const char* bytes = reinterpret_cast<const char*>(rows_of(cache, j));
        for (int64_t line = 0; line < span_bytes; line += 64) __builtin_prefetch(bytes + line);
      };
      for (int64_t j = lo; j < std::min(lo + kPrefetchKeys, pos + 1); ++j) prefetch(k_base, j);
      for (int64_t tile = lo; tile <= pos; tile += kTileKeys) {
        const int64_t n = std::min(kTileKeys, pos + 1 - tile);
        for (int64_t j = 0; j < n; ++j) {
          prefetch(k_base, tile + j + kPrefetchKeys);
          prefetch(v_base, tile + j);  // read after this tile's softmax
          to_float(rows_of(k_base, tile + j), kv, span);
          for (int64_t r = 0; r < rows; ++r) {
            float score = dot(q + r * head_size, kv + (r / group) * head_size, head_size) * fscale;
            if (cap > 0.f) score = cap * std::tanh(score / cap);
            if (alibi_slopes != nullptr) score += alibi_slopes[h0 * group + r] * static_cast<float>(tile + j - pos);
            scores[r * kTileKeys + j] = score;
          }
        }
        for (int64_t r = 0; r < rows; ++r) {
          float* __restrict sr = scores + r * kTileKeys;
          float tile_max = row_max[r];
          for (int64_t j = 0; j < n; ++j) tile_max = std::max(tile_max, sr[j]);
          const float rescale = std::exp(row_max[r] - tile_max);  // 0 on the first tile
          row_max[r] = tile_max;
          float* __restrict a = acc + r * head_size;
#pragma omp simd
          for (int64_t d = 0; d < head_size; ++d) a[d] *= rescale;
          float tile_sum = 0.f;
#pragma omp simd reduction(+ : tile_sum)
          for (int64_t j = 0; j < n; ++j) {
            sr[j] = exp_approx(sr[j] - tile_max);
            tile_sum += sr[j];
          }
          row_sum[r] = row_sum[r] * rescale + tile_sum;
        }
        for (int64_t j = 0; j < n; ++j) {
          to_float(rows_of(v_base, tile + j), kv, span);
          for (int64_t r = 0; r < rows; ++r) {
            const float p = scores[r * kTileKeys + j];
            const float* __restrict v = kv + (r / group) * head_size;
            float* __restrict a = acc + r * head_size;
#pragma omp simd
            for (int64_t d = 0; d < head_size; ++d) a[d] += p * v[d];
          }
        }
      }
      scalar_t* o = out_base + t * out_stride + h0 * group * head_size;
      for (int64_t r = 0; r < rows; ++r) {
        const float inv = 1.f / row_sum[r];
#pragma omp simd
        for (int64_t d = 0; d < head_size; ++d) o[r * head_size + d] = store<scalar_t>(acc[r * head_size + d] * inv);
      }
    }
  });
}

}  // namespace

void paged_attention(
    const at::Tensor& out,
    const at::Tensor& query,
    const at::Tensor& key_cache,
    const at::Tensor& value_cache,
    const at::Tensor& block_tables,
    const at::Tensor& seq_lens,
    const at::Tensor& query_start_loc,
    double scale,
    int64_t sliding_window,
    double logits_soft_cap,
    const std::optional<at::Tensor>& alibi_slopes) {
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1 && query.stride(1) == query.size(2),
              "query must be [num_tokens, num_heads, head_size] with contiguous heads");
  TORCH_CHECK(out.sizes() == query.sizes() && out.stride(2) == 1 && out.stride(1) == out.size(2),
              "out must have the query's shape, with contiguous heads");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.is_contiguous() && value_cache.is_contiguous() &&
                  key_cache.sizes() == value_cache.sizes(),
              "key_cache and value_cache must be contiguous [num_blocks, block_size, num_kv_heads, head_size]");
  const auto dtype = query.scalar_type();
  TORCH_CHECK(key_cache.scalar_type() == dtype && value_cache.scalar_type() == dtype && out.scalar_type() == dtype,
              "query, out and the caches must share one dtype");
  TORCH_CHECK(key_cache.size(3) == query.size(2), "the caches' head_size differs from the query's");
  const int64_t num_kv_heads = key_cache.size(2);
  TORCH_CHECK(num_kv_heads > 0 && query.size(1) % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
  for (const at::Tensor* t : {&block_tables, &seq_lens, &query_start_loc}) {
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous() && t->device().is_cpu(),
                "block_tables, seq_lens and query_start_loc must be contiguous int32 CPU tensors");
  }
  TORCH_CHECK(query_start_loc.size(0) == seq_lens.size(0) + 1 && block_tables.size(0) >= seq_lens.size(0),
              "query_start_loc needs num_seqs + 1 entries and block_tables a row per sequence");
  // The metadata decides every address read: check it all (a few hundred integers a step) so that
  // a wrong table raises here instead of reading outside the cache.
  const int64_t num_seqs = seq_lens.size(0), num_blocks = key_cache.size(0), block_size = key_cache.size(1);
  const int32_t* starts = query_start_loc.const_data_ptr<int32_t>();
  const int32_t* lens = seq_lens.const_data_ptr<int32_t>();
  const int32_t* tables = block_tables.const_data_ptr<int32_t>();
  TORCH_CHECK(starts[0] >= 0 && starts[num_seqs] <= query.size(0), "query_start_loc runs outside the query");
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t query_len = starts[s + 1] - starts[s];
    TORCH_CHECK(query_len >= 0 && query_len <= lens[s], "sequence ", s, " has ", query_len,
                " queries for a context of ", lens[s]);
    const int64_t used_blocks = (lens[s] + block_size - 1) / block_size;
    TORCH_CHECK(used_blocks <= block_tables.size(1), "sequence ", s, "'s context of ", lens[s],
                " tokens needs more blocks than its block table row holds");
    for (int64_t b = 0; b < used_blocks; ++b) {
      const int32_t block = tables[s * block_tables.size(1) + b];
      TORCH_CHECK(block >= 0 && block < num_blocks, "sequence ", s, " maps to block ", block, " outside the cache's ",
                  num_blocks);
    }
  }
  const float* slopes = nullptr;
  at::Tensor slopes_f32;
  if (alibi_slopes.has_value()) {
    slopes_f32 = alibi_slopes->to(at::kFloat).contiguous();
    TORCH_CHECK(slopes_f32.numel() == query.size(1), "alibi_slopes needs one slope per query head");
    slopes = slopes_f32.const_data_ptr<float>();
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "paged_attention", [&] {
    paged_attention_impl<scalar_t>(out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                                   sliding_window, logits_soft_cap, slopes);
  });
}

}  // namespace pagedllm_cpu
