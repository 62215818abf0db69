// The operators' schemas (what torch.ops.pagedllm_cpu.* accept) and their CPU implementations.
#include <torch/library.h>

#include "ops.h"

TORCH_LIBRARY(pagedllm_cpu, m) {
  m.def(
      "reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
      "Tensor slot_mapping) -> ()");
  m.impl("reshape_and_cache", c10::DispatchKey::CPU, TORCH_FN(pagedllm_cpu::reshape_and_cache));
  m.def(
      "paged_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
      "Tensor seq_lens, Tensor query_start_loc, float scale, int sliding_window, float logits_soft_cap, "
      "Tensor? alibi_slopes) -> ()");
  m.impl("paged_attention", c10::DispatchKey::CPU, TORCH_FN(pagedllm_cpu::paged_attention));
  m.def("rms_norm(Tensor(a!) x, Tensor(b!)? residual, Tensor weight, float eps) -> ()");
  m.impl("rms_norm", c10::DispatchKey::CPU, TORCH_FN(pagedllm_cpu::rms_norm));
  m.def("rotary_embedding(Tensor positions, Tensor(a!) query, Tensor(b!) key, Tensor cos_sin_cache, int head_size) -> ()");
  m.impl("rotary_embedding", c10::DispatchKey::CPU, TORCH_FN(pagedllm_cpu::rotary_embedding));
  m.def("int4_matmul_few_rows(Tensor(a!) out, Tensor x, Tensor packed, Tensor scales_and_zeros) -> ()");
  m.impl("int4_matmul_few_rows", c10::DispatchKey::CPU, TORCH_FN(pagedllm_cpu::int4_matmul_few_rows));
  // No tensor to dispatch on: one kernel for every backend.
  m.def("int4_prefill_supported() -> bool", TORCH_FN(pagedllm_cpu::int4_prefill_supported));
  m.def("int4_prefill_matmul(Tensor(a!) out, Tensor x, Tensor packed, Tensor scales_and_zeros) -> ()");
  m.impl("int4_prefill_matmul", c10::DispatchKey::CPU, TORCH_FN(pagedllm_cpu::int4_prefill_matmul));
  m.def("int4_dequantize(Tensor(a!) out, Tensor packed, Tensor scales_and_zeros, int start) -> ()");
  m.impl("int4_dequantize", c10::DispatchKey::CPU, TORCH_FN(pagedllm_cpu::int4_dequantize));
  m.def("argmax_logsumexp(Tensor logits, Tensor(a!) argmax, Tensor(b!) logsumexp) -> ()");
  m.impl("argmax_logsumexp", c10::DispatchKey::CPU, TORCH_FN(pagedllm_cpu::argmax_logsumexp));
}
