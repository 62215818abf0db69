// The cache write of a step: each new token's K and V rows copied into its slot of the paged
// cache (vLLM's reshape_and_cache, in this layout). One operator instead of the PyTorch path's
// padding check and two index_copy_ calls a layer.
//
// Grid: at::parallel_for over tokens; a program copies its tokens' rows.
// Layouts: key, value [num_tokens, num_kv_heads, head_size], heads contiguous (any token stride:
// they are views into the fused QKV output); key_cache, value_cache [num_blocks, block_size,
// num_kv_heads, head_size] contiguous, in the key's dtype; slot_mapping [num_tokens] int64, slot
// = block * block_size + offset, negative for padding tokens (skipped). Every slot is checked
// against the cache's size before anything is written.
// Bound: a copy of 2 * num_tokens * num_kv_heads * head_size elements.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <cstring>

#include "ops.h"

namespace pagedllm_cpu {

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
                       const at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.is_contiguous() && value_cache.is_contiguous() &&
                  key_cache.sizes() == value_cache.sizes(),
              "key_cache and value_cache must be contiguous [num_blocks, block_size, num_kv_heads, head_size]");
  const int64_t num_kv_heads = key_cache.size(2), head_size = key_cache.size(3);
  const int64_t row = num_kv_heads * head_size;
  for (const at::Tensor* t : {&key, &value}) {
    TORCH_CHECK(t->dim() == 3 && t->size(1) == num_kv_heads && t->size(2) == head_size && t->stride(2) == 1 &&
                    t->stride(1) == head_size,
                "key and value must be [num_tokens, num_kv_heads, head_size] with contiguous heads");
    TORCH_CHECK(t->scalar_type() == key_cache.scalar_type() && value_cache.scalar_type() == key_cache.scalar_type(),
                "key, value and the caches must share one dtype");
  }
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.size(0) <= key.size(0) && value.size(0) == key.size(0),
              "slot_mapping must be a contiguous int64 [num_tokens] tensor");
  const int64_t num_tokens = slot_mapping.size(0);
  const int64_t num_slots = key_cache.size(0) * key_cache.size(1);
  const int64_t* slots = slot_mapping.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t) {
    TORCH_CHECK(slots[t] < num_slots, "slot ", slots[t], " is past the cache's ", num_slots, " slots");
  }
  const int64_t bytes = row * static_cast<int64_t>(key.element_size());
  const char* k = static_cast<const char*>(key.const_data_ptr());
  const char* v = static_cast<const char*>(value.const_data_ptr());
  char* kc = static_cast<char*>(key_cache.mutable_data_ptr());
  char* vc = static_cast<char*>(value_cache.mutable_data_ptr());
  const int64_t k_stride = key.stride(0) * key.element_size(), v_stride = value.stride(0) * value.element_size();
  at::parallel_for(0, num_tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (slots[t] < 0) continue;
      std::memcpy(kc + slots[t] * bytes, k + t * k_stride, bytes);
      std::memcpy(vc + slots[t] * bytes, v + t * v_stride, bytes);
    }
  });
}

}  // namespace pagedllm_cpu
