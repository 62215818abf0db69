// The torch side of the CUDA kernels: every tensor checked (shape, dtype, device, strides,
// alignment), then the plain launchers of ops.h on the current stream of the tensors' device.
// Built with the .cu files by torch.utils.cpp_extension.load (pagedllm/kernels/cuda/build.py).
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <climits>
#include <cstdint>
#include <optional>

#include "ops.h"

namespace {

using pagedllm::ScalarType;
using torch::Tensor;

ScalarType scalar_type_of(const Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return ScalarType::kFloat32;
    case at::kHalf:
      return ScalarType::kFloat16;
    case at::kBFloat16:
      return ScalarType::kBFloat16;
    default:
      TORCH_CHECK(false, "pagedllm cuda kernels: dtype ", t.scalar_type(), " is not float32, float16 or bfloat16");
  }
}

int as_int(int64_t value, const char* what) {
  TORCH_CHECK(value >= 0 && value <= INT_MAX, what, " = ", value, " does not fit the kernels' int indexing");
  return static_cast<int>(value);
}

void check_on(const Tensor& t, const Tensor& like, const char* name) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
  TORCH_CHECK(t.device() == like.device(), name, " is on ", t.device(), ", expected ", like.device());
}

// vLLM's original layout: K [num_blocks, num_kv_heads, head_size / x, block_size, x] and V [num_blocks,
// num_kv_heads, head_size, block_size], x = 16 / element size, both contiguous, so the two share
// the block and KV-head strides the kernels take.
struct CacheGeometry {
  int num_kv_heads;
  int head_size;
  int block_size;
};

CacheGeometry check_caches(const Tensor& key_cache, const Tensor& value_cache) {
  check_on(key_cache, key_cache, "key_cache");
  check_on(value_cache, key_cache, "value_cache");
  TORCH_CHECK(key_cache.dtype() == value_cache.dtype(), "key_cache and value_cache dtypes differ");
  scalar_type_of(key_cache);
  TORCH_CHECK(key_cache.dim() == 5 && value_cache.dim() == 4,
              "want key_cache [num_blocks, num_kv_heads, head_size/x, block_size, x] and value_cache "
              "[num_blocks, num_kv_heads, head_size, block_size], got ",
              key_cache.sizes(), " and ", value_cache.sizes());
  const int64_t x = 16 / key_cache.element_size();
  TORCH_CHECK(key_cache.size(4) == x, "key_cache's last dimension must be x = ", x, ", got ", key_cache.size(4));
  const int64_t head_size = key_cache.size(2) * x;
  const std::vector<int64_t> value_shape = {key_cache.size(0), key_cache.size(1), head_size, key_cache.size(3)};
  TORCH_CHECK(value_cache.sizes() == at::IntArrayRef(value_shape), "value_cache ", value_cache.sizes(),
              " does not match key_cache ", key_cache.sizes(), ": want ", at::IntArrayRef(value_shape));
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "the caches must be contiguous");
  return {as_int(key_cache.size(1), "num_kv_heads"), as_int(head_size, "head_size"),
          as_int(key_cache.size(3), "block_size")};
}

// [num_tokens, num_heads, head_size] with each head's head_size elements contiguous and adjacent;
// the token stride is free (q, k, v are usually views of one fused projection).
void check_token_major(const Tensor& t, const Tensor& like, const char* name, int64_t num_heads, int64_t head_size) {
  check_on(t, like, name);
  TORCH_CHECK(t.dtype() == like.dtype(), name, " is ", t.dtype(), ", the cache is ", like.dtype());
  TORCH_CHECK(t.dim() == 3 && t.size(1) == num_heads && t.size(2) == head_size, name, " ", t.sizes(),
              " is not [num_tokens, ", num_heads, ", ", head_size, "]");
  TORCH_CHECK(t.stride(2) == 1 && t.stride(1) == head_size, name, " strides ", t.strides(),
              ": heads must be contiguous and adjacent");
}

void reshape_and_cache(const Tensor& key, const Tensor& value, Tensor& key_cache, Tensor& value_cache,
                       const Tensor& slot_mapping) {
  const CacheGeometry cache = check_caches(key_cache, value_cache);
  check_token_major(key, key_cache, "key", cache.num_kv_heads, cache.head_size);
  check_token_major(value, key_cache, "value", cache.num_kv_heads, cache.head_size);
  TORCH_CHECK(value.size(0) == key.size(0), "key and value have different numbers of tokens");
  check_on(slot_mapping, key_cache, "slot_mapping");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 &&
                  slot_mapping.size(0) == key.size(0) && slot_mapping.is_contiguous(),
              "slot_mapping must be a contiguous int64 [num_tokens] tensor");
  const c10::cuda::OptionalCUDAGuard device_guard(key_cache.device());
  pagedllm::CacheWriteParams params{};
  params.key = key.data_ptr();
  params.value = value.data_ptr();
  params.key_cache = key_cache.data_ptr();
  params.value_cache = value_cache.data_ptr();
  params.slot_mapping = slot_mapping.data_ptr<int64_t>();
  params.num_tokens = as_int(key.size(0), "num_tokens");
  params.num_kv_heads = cache.num_kv_heads;
  params.head_size = cache.head_size;
  params.block_size = cache.block_size;
  params.key_stride = key.stride(0);
  params.value_stride = value.stride(0);
  params.dtype = scalar_type_of(key_cache);
  pagedllm::reshape_and_cache(params, c10::cuda::getCurrentCUDAStream());
}

pagedllm::PagedAttentionParams check_attention(const Tensor& query, const Tensor& key_cache,
                                               const Tensor& value_cache, const Tensor& block_tables,
                                               const Tensor& seq_lens, double scale, int64_t max_seq_len,
                                               const Tensor& out, const std::optional<Tensor>& alibi_slopes) {
  const CacheGeometry cache = check_caches(key_cache, value_cache);
  TORCH_CHECK(query.dim() == 3, "query ", query.sizes(), " is not [num_seqs, num_heads, head_size]");
  const int64_t num_seqs = query.size(0);
  const int64_t num_heads = query.size(1);
  check_token_major(query, key_cache, "query", num_heads, cache.head_size);
  TORCH_CHECK(num_heads % cache.num_kv_heads == 0, "num_heads ", num_heads, " is not a multiple of num_kv_heads ",
              cache.num_kv_heads);
  // The kernels read the query 16 bytes at a time.
  const int64_t x = 16 / query.element_size();
  TORCH_CHECK(reinterpret_cast<uintptr_t>(query.data_ptr()) % 16 == 0 && query.stride(0) % x == 0,
              "query rows must start on 16-byte boundaries");
  check_on(out, key_cache, "out");
  TORCH_CHECK(out.dtype() == query.dtype() && out.sizes() == query.sizes() && out.is_contiguous(),
              "out must be a contiguous tensor of the query's shape and dtype");
  check_on(block_tables, key_cache, "block_tables");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 && block_tables.size(0) == num_seqs &&
                  block_tables.is_contiguous(),
              "block_tables must be a contiguous int32 [num_seqs, max_num_blocks_per_seq] tensor");
  check_on(seq_lens, key_cache, "seq_lens");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.dim() == 1 && seq_lens.size(0) == num_seqs &&
                  seq_lens.is_contiguous(),
              "seq_lens must be a contiguous int32 [num_seqs] tensor");
  TORCH_CHECK(max_seq_len >= 1, "max_seq_len must be positive, got ", max_seq_len);
  const float* alibi_ptr = nullptr;
  if (alibi_slopes.has_value()) {
    const Tensor& slopes = alibi_slopes.value();
    check_on(slopes, key_cache, "alibi_slopes");
    TORCH_CHECK(slopes.scalar_type() == at::kFloat && slopes.dim() == 1 && slopes.size(0) == num_heads &&
                    slopes.is_contiguous(),
                "alibi_slopes must be a contiguous float32 [num_heads] tensor");
    alibi_ptr = slopes.data_ptr<float>();
  }
  pagedllm::PagedAttentionParams params{};
  params.out = out.data_ptr();
  params.query = query.data_ptr();
  params.key_cache = key_cache.data_ptr();
  params.value_cache = value_cache.data_ptr();
  params.block_tables = block_tables.data_ptr<int>();
  params.seq_lens = seq_lens.data_ptr<int>();
  params.alibi_slopes = alibi_ptr;
  params.scale = static_cast<float>(scale);
  params.num_seqs = as_int(num_seqs, "num_seqs");
  params.num_heads = as_int(num_heads, "num_heads");
  params.num_kv_heads = cache.num_kv_heads;
  params.head_size = cache.head_size;
  params.block_size = cache.block_size;
  params.max_num_blocks_per_seq = as_int(block_tables.size(1), "max_num_blocks_per_seq");
  params.max_seq_len = as_int(max_seq_len, "max_seq_len");
  params.q_stride = as_int(query.stride(0), "query stride");
  params.kv_block_stride = as_int(key_cache.stride(0), "cache block stride");
  params.kv_head_stride = as_int(key_cache.stride(1), "cache head stride");
  params.dtype = scalar_type_of(key_cache);
  return params;
}

void paged_attention_v1(const Tensor& query, const Tensor& key_cache, const Tensor& value_cache,
                        const Tensor& block_tables, const Tensor& seq_lens, double scale, int64_t max_seq_len,
                        Tensor& out, const std::optional<Tensor>& alibi_slopes) {
  const pagedllm::PagedAttentionParams params = check_attention(
      query, key_cache, value_cache, block_tables, seq_lens, scale, max_seq_len, out, alibi_slopes);
  if (params.num_seqs == 0) {
    return;
  }
  const c10::cuda::OptionalCUDAGuard device_guard(query.device());
  pagedllm::paged_attention_v1(params, c10::cuda::getCurrentCUDAStream());
}

void paged_attention_v2(const Tensor& query, const Tensor& key_cache, const Tensor& value_cache,
                        const Tensor& block_tables, const Tensor& seq_lens, double scale, int64_t max_seq_len,
                        Tensor& out, const std::optional<Tensor>& alibi_slopes) {
  const pagedllm::PagedAttentionParams params = check_attention(
      query, key_cache, value_cache, block_tables, seq_lens, scale, max_seq_len, out, alibi_slopes);
  if (params.num_seqs == 0) {
    return;
  }
  const c10::cuda::OptionalCUDAGuard device_guard(query.device());
  const int64_t max_num_partitions = (max_seq_len + pagedllm::kPartitionSize - 1) / pagedllm::kPartitionSize;
  TORCH_CHECK(max_num_partitions <= 65535, "max_seq_len ", max_seq_len, " needs more partitions than a grid holds");
  // Scratch from the caching allocator: no device sync, and capturable in a CUDA graph.
  const auto options = query.options().dtype(at::kFloat);
  Tensor exp_sums = torch::empty({params.num_seqs, params.num_heads, max_num_partitions}, options);
  Tensor max_logits = torch::empty_like(exp_sums);
  Tensor tmp_out = torch::empty({params.num_seqs, params.num_heads, max_num_partitions, params.head_size}, options);
  const pagedllm::PartitionWorkspace workspace{exp_sums.data_ptr<float>(), max_logits.data_ptr<float>(),
                                               tmp_out.data_ptr<float>(), static_cast<int>(max_num_partitions)};
  pagedllm::paged_attention_v2(params, workspace, c10::cuda::getCurrentCUDAStream());
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "pagedllm's PagedAttention CUDA kernels (vLLM's original cache layout); see pagedllm.kernels.cuda";
  m.attr("PARTITION_SIZE") = pagedllm::kPartitionSize;
  m.def("reshape_and_cache", &reshape_and_cache, "Write K/V into the paged cache at slot_mapping",
        py::arg("key"), py::arg("value"), py::arg("key_cache"), py::arg("value_cache"), py::arg("slot_mapping"));
  m.def("paged_attention_v1", &paged_attention_v1, "Decode attention, one thread block per (head, sequence)",
        py::arg("query"), py::arg("key_cache"), py::arg("value_cache"), py::arg("block_tables"), py::arg("seq_lens"),
        py::arg("scale"), py::arg("max_seq_len"), py::arg("out"), py::arg("alibi_slopes") = py::none());
  m.def("paged_attention_v2", &paged_attention_v2, "Decode attention split into partitions, then reduced",
        py::arg("query"), py::arg("key_cache"), py::arg("value_cache"), py::arg("block_tables"), py::arg("seq_lens"),
        py::arg("scale"), py::arg("max_seq_len"), py::arg("out"), py::arg("alibi_slopes") = py::none());
}
