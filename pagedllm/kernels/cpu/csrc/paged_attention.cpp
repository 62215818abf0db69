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
// arithmetic is float32, whatever the cache's dtype.
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
// is cold (the layers' weights stream through the caches in between), so misses set the pace: C1's
// decode layer (32 sequences of ~100 tokens, 3 KV heads of 64, 2.4 MB of K and V) takes ~0.15 ms
// warm and ~0.21 ms cold in the engine on two cores. Items of single heads, reading 128 B of every
// 384 B row, took ~0.55 ms cold; whole rows with a tile's prefetches issued at once (they wait for
// free miss buffers) ~0.3 ms; each key's rows are now prefetched kPrefetchKeys keys ahead.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "ops.h"
#include "vec_math.h"

namespace pagedllm_cpu {

namespace {

constexpr int64_t kTileKeys = 32;
constexpr int64_t kPrefetchKeys = 8;

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
