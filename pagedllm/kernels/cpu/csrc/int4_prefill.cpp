// Prefill-sized products with an int4 weight (int4_layout.h): the weight decoded to bf16 a tile
// of output rows at a time, each tile a GEMM, so that no dense copy of the weight exists.
//
// int4_prefill_matmul: out = x W^T, each tile of tile_n output rows (kTileBytes of bf16) decoded
// straight into the VNNI layout of oneDNN's brgemm micro-kernel (on AMX: bf16 pairs of
// consecutive inputs, B [K / 2][tile_n][2]) and multiplied by at::native::cpublas::brgemm, the
// ukernel behind PyTorch's CPU flash attention and Inductor's CPU GEMM templates. Decoding into torch.mm's
// row-major operand instead (int4_dequantize, below) makes oneDNN reorder each tile into this
// very layout inside every call, and the row-major decode is a transpose: at 1,000 rows of
// SmolLM2's four shapes (one thread) that path took 13.9 ms a layer against the prepacked bf16
// GEMM's 7.6, 5 ms of it the row-major decode.
//   Grid: at::parallel_for over blocks of 64 outputs (times parts of M where blocks are fewer
//   than threads); a program takes its run of blocks tile_n outputs at a time, decodes the tile
//   (float32 values rounded once to bf16, as int4_dequantize rounds them) into its thread's
//   scratch (kept from call to call: no page faulted in per product), then runs the brgemm
//   over its rows of x in blocks of kBlockM, accumulating in float32 over all of K, and rounds
//   each block's outputs to bf16 into out.
//   Layouts: x bf16 [M, K], rows contiguous; out bf16 [M, N] contiguous; the weight as in
//   int4_layout.h (N a multiple of 64, K of 32).
//   Bound: N K / 2 + 4 N K / 32 bytes of weight read once per call; x read once per tile
//   (2 M K N / tile_n bytes, from L2 or L3); 2 M N K FLOPs at the AMX tile rate; the decode is
//   O(N K), independent of M.
//   ATen generates a brgemm kernel per (rows, width, K) and keeps it per thread: with M split
//   into blocks of kBlockM, at most kBlockM row counts per weight shape, each generated once.
//
// int4_dequantize: rows [start, start + R) of the weight as a row-major bf16 [R, K] tensor, for
// the path that multiplies with torch.mm where the brgemm ukernel does not run (no AMX).
//   Grid: at::parallel_for over blocks of 64 rows; a program decodes a group of 32 inputs at a
//   time into a float tile [32 inputs][64 rows], then writes its 64 row segments transposed.
//   Bound: R K / 2 + 4 R K / 32 bytes read, 2 R K written.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <cstdlib>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "int4_layout.h"
#include "ops.h"

namespace pagedllm_cpu {

namespace {

namespace cpublas = at::native::cpublas;

// Bytes of a tile's VNNI copy (2 K bytes per output row: 640 outputs at K = 576, 256 at 1,536): it
// stays in L2 (2 MB a core here) while each block of kBlockM rows of x meets it, and x, read once
// per tile, is read N / width times (from L3 where x outgrows L2). kBlockM: rows of x per brgemm
// call, 36 KB at K = 576, which stay in L1 while the micro-kernel sweeps the tile's columns; the
// block's float32 C is rounded into out while still in cache. Chosen by measurement at 1,000 rows
// of SmolLM2's shapes, one thread, L2 flushed between products (as a model's other layers flush
// it), alternating configurations round by round (medians of 80 rounds, ms a layer): 768 KB and
// 32 rows 7.67, 1 MB and 32 rows 7.81, 512 KB and 32 rows 8.75, 512 KB and 64 rows 8.39 (the
// previous choice, made while each call allocated its tile afresh, which cost large tiles most);
// 768 KB and 32 rows was the fastest on each of the four shapes. End to end the two were level
// (1,000-token prefills alternating the two in one engine: median TTFT ratio 1.007, 16 pairs).
constexpr int64_t kTileBytes = 768 * 1024, kBlockM = 32;

// VNNI rows [16 g, 16 g + 16) of a tile (inputs 32 g .. 32 g + 31) for one block's 64 outputs, at
// dst ([16][ld] words), from the group's nibbles (`bytes`, [32 inputs][32 bytes]) and its 64
// (scale, zero) pairs: each 32-bit word holds the bf16 weights of inputs 2 p (low half) and
// 2 p + 1 (high half) of one output.
#if defined(__AVX512BF16__)
// Each pair of input rows decoded, rounded and interleaved in registers: 128 weights in ~40
// instructions. (The portable form below, through a float32 tile, was ~4x slower.)
void decode_group_vnni(const uint8_t* bytes, const c10::BFloat16* pairs, uint32_t* dst, int64_t ld) {
  float scales[kBlockN], offsets[kBlockN];
  group_scales(pairs, scales, offsets);
  __m512 scale[4], offset[4];  // outputs 16 c .. 16 c + 15
  for (int c = 0; c < 4; ++c) {
    scale[c] = _mm512_loadu_ps(scales + 16 * c);
    offset[c] = _mm512_loadu_ps(offsets + 16 * c);
  }
  // cvtne2ps gives [even 0..15 | odd 0..15] as bf16; this takes them to even 0, odd 0, even 1, ...
  alignas(64) uint16_t order[32];
  for (int i = 0; i < 16; ++i) order[2 * i] = i, order[2 * i + 1] = 16 + i;
  const __m512i interleave = _mm512_load_si512(order);
  const __m256i low_nibbles = _mm256_set1_epi8(0x0F);
  for (int64_t p = 0; p < kGroup / 2; ++p) {
    __m256i q[2][2];  // [input 2 p, 2 p + 1][outputs 0..31 (low nibbles), 32..63 (high)]
    for (int r = 0; r < 2; ++r) {
      const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes + (2 * p + r) * 32));
      q[r][0] = _mm256_and_si256(packed, low_nibbles);
      q[r][1] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low_nibbles);
    }
    for (int c = 0; c < 4; ++c) {
      __m512 w[2];
      for (int r = 0; r < 2; ++r) {
        const __m256i half = q[r][c / 2];
        const __m128i bytes16 = c % 2 ? _mm256_extracti128_si256(half, 1) : _mm256_castsi256_si128(half);
        w[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes16)), scale[c], offset[c]);
      }
      const __m512i both = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(w[1], w[0]));
      _mm512_storeu_si512(dst + p * ld + 16 * c, _mm512_permutexvar_epi16(interleave, both));
    }
  }
}
#else
void decode_group_vnni(const uint8_t* bytes, const c10::BFloat16* pairs, uint32_t* dst, int64_t ld) {
  float tile[kGroup][kBlockN];
  decode_group(bytes, pairs, tile);
  for (int64_t p = 0; p < kGroup / 2; ++p) {
#pragma omp simd
    for (int64_t n = 0; n < kBlockN; ++n) {
      const uint32_t even = store<c10::BFloat16>(tile[2 * p][n]).x;
      const uint32_t odd = store<c10::BFloat16>(tile[2 * p + 1][n]).x;
      dst[p * ld + n] = even | (odd << 16);
    }
  }
}
#endif

// At least `bytes` of this thread's scratch, 64-byte aligned and kept from call to call (grown,
// never shrunk). A std::vector per call was zero-filled, and at ~600 KB came from mmap, so that
// its pages faulted in again on every product: with glibc's mmap threshold raised (the buffers
// then reused from the heap) the kernel's median at 1,000 rows fell from 12.3 to 10.1 ms a layer.
void* thread_scratch(size_t bytes) {
  struct Scratch {
    void* data = nullptr;
    size_t bytes = 0;
    ~Scratch() { std::free(data); }
  };
  thread_local Scratch scratch;
  if (scratch.bytes < bytes) {
    std::free(scratch.data);
    const size_t rounded = (bytes + 63) / 64 * 64;  // aligned_alloc takes a multiple of the alignment
    scratch.data = std::aligned_alloc(64, rounded);
    scratch.bytes = scratch.data ? rounded : 0;
    TORCH_CHECK(scratch.data != nullptr, "int4_prefill_matmul: cannot allocate ", rounded, " bytes of scratch");
  }
  return scratch.data;
}

// A product's operands: x [M, K] (rows ld_x apart), the int4 weight, out [M, N].
struct Operands {
  const at::BFloat16* x;
  int64_t ld_x;
  const uint8_t* weight;
  const c10::BFloat16* scales_and_zeros;
  c10::BFloat16* out;
  int64_t M, N, K;
};

// The tile of outputs [n0, n0 + width) in VNNI layout: vnni [K / 2][width] words.
void decode_tile_vnni(const Operands& p, int64_t n0, int64_t width, uint32_t* vnni) {
  for (int64_t b = n0 / kBlockN; b < (n0 + width) / kBlockN; ++b) {
    for (int64_t g = 0; g < p.K / kGroup; ++g) {
      decode_group_vnni(p.weight + (b * p.K + g * kGroup) * 32, p.scales_and_zeros + (g * p.N + b * kBlockN) * 2,
                        vnni + g * (kGroup / 2) * width + (b * kBlockN - n0), width);
    }
  }
}

// row[0:width] <- c[0:width] rounded to nearest even bf16 (width a multiple of 16): one instruction
// per 16 values where AVX512-BF16 has it, against ~7 integer operations for store<BFloat16>. The
// two agree on every sum brgemm writes (AMX flushes denormals, which the instruction would read
// as zero); a NaN stays a NaN.
inline void round_row(const float* c, c10::BFloat16* row, int64_t width) {
#if defined(__AVX512BF16__)
  for (int64_t n = 0; n < width; n += 16) {
    const __m256i bits = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_loadu_ps(c + n)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + n), bits);
  }
#else
#pragma omp simd
  for (int64_t n = 0; n < width; ++n) row[n] = store<c10::BFloat16>(c[n]);
#endif
}

// out[m_begin:m_end, n0:n0 + width] <- x[m_begin:m_end] times the decoded tile, kBlockM rows per
// brgemm into the float32 block c, each block rounded to bf16 once.
void multiply_tile(const Operands& p, int64_t m_begin, int64_t m_end, int64_t n0, int64_t width,
                   const uint32_t* vnni, float* c) {
  const auto* b = reinterpret_cast<const at::BFloat16*>(vnni);
  for (int64_t m0 = m_begin; m0 < m_end; m0 += kBlockM) {
    const int64_t rows = std::min(kBlockM, m_end - m0);
    cpublas::brgemm(rows, width, p.K, p.ld_x, width, width, /*add_C=*/false, p.x + m0 * p.ld_x, b, c);
    for (int64_t r = 0; r < rows; ++r) round_row(c + r * width, p.out + (m0 + r) * p.N + n0, width);
  }
}

}  // namespace

bool int4_prefill_supported() { return cpublas::could_pack(at::kBFloat16); }

void int4_prefill_matmul(const at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
                         const at::Tensor& scales_and_zeros) {
  TORCH_CHECK(int4_prefill_supported(), "int4_prefill_matmul needs oneDNN's brgemm ukernel with AMX bf16");
  const auto [N, K] = check_int4_weight(packed, scales_and_zeros);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.size(1) == K && x.stride(1) == 1,
              "x must be a bf16 [M, K] tensor with contiguous rows, K = packed.size(1) * 2");
  const int64_t M = x.size(0);
  TORCH_CHECK(out.scalar_type() == at::kBFloat16 && out.is_contiguous() && out.dim() == 2 && out.size(0) == M &&
                  out.size(1) == N,
              "out must be a contiguous bf16 [M, N] tensor");
  if (M == 0 || N == 0) return;
  const Operands p{x.const_data_ptr<at::BFloat16>(), x.stride(0), packed.const_data_ptr<uint8_t>(),
                   scales_and_zeros.const_data_ptr<c10::BFloat16>(), out.mutable_data_ptr<c10::BFloat16>(), M, N, K};
  // Threads share out the blocks of 64 outputs, a contiguous run each, multiplied tile_n at a
  // time. With fewer blocks than threads (a narrow weight on many cores) the rows are split too,
  // into m_parts: each part decodes the tiles it multiplies again, a small cost beside kBlockM
  // rows or more of GEMM.
  const int64_t num_blocks = N / kBlockN, max_m_parts = (M + kBlockM - 1) / kBlockM;
  const int64_t m_parts = std::clamp<int64_t>(at::get_num_threads() / num_blocks, 1, max_m_parts);
  const int64_t tile_n = std::max<int64_t>(1, kTileBytes / (2 * K) / kBlockN) * kBlockN;  // outputs per tile
  const size_t vnni_bytes = K / 2 * tile_n * sizeof(uint32_t);
  at::parallel_for(0, m_parts * num_blocks, 1, [&](int64_t begin, int64_t end) {
    auto* vnni = static_cast<uint32_t*>(thread_scratch(vnni_bytes + kBlockM * tile_n * sizeof(float)));
    auto* c = reinterpret_cast<float*>(reinterpret_cast<char*>(vnni) + vnni_bytes);
    for (int64_t i = begin; i < end;) {
      const int64_t part = i / num_blocks, b0 = i % num_blocks;
      const int64_t blocks = std::min({tile_n / kBlockN, num_blocks - b0, end - i});
      decode_tile_vnni(p, b0 * kBlockN, blocks * kBlockN, vnni);
      multiply_tile(p, M * part / m_parts, M * (part + 1) / m_parts, b0 * kBlockN, blocks * kBlockN, vnni, c);
      i += blocks;
    }
    // Hand the AMX tile configuration back before the thread runs other oneDNN code.
    cpublas::brgemm_release();
  });
}

void int4_dequantize(const at::Tensor& out, const at::Tensor& packed, const at::Tensor& scales_and_zeros,
                     int64_t start) {
  const auto [N, K] = check_int4_weight(packed, scales_and_zeros);
  const int64_t R = out.size(0);
  TORCH_CHECK(out.scalar_type() == at::kBFloat16 && out.is_contiguous() && out.dim() == 2 && out.size(1) == K,
              "out must be a contiguous bf16 [R, K] tensor");
  TORCH_CHECK(start % kBlockN == 0 && R % kBlockN == 0 && start >= 0 && start + R <= N,
              "start and R must be multiples of 64 within N");
  const uint8_t* weight = packed.const_data_ptr<uint8_t>();
  const c10::BFloat16* sz = scales_and_zeros.const_data_ptr<c10::BFloat16>();
  c10::BFloat16* w = out.mutable_data_ptr<c10::BFloat16>();
  at::parallel_for(start / kBlockN, (start + R) / kBlockN, 1, [&](int64_t begin, int64_t end) {
    float tile[kGroup][kBlockN];
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t g = 0; g < K / kGroup; ++g) {
        decode_group(weight + (b * K + g * kGroup) * 32, sz + (g * N + b * kBlockN) * 2, tile);
        for (int64_t n = 0; n < kBlockN; ++n) {
          c10::BFloat16* row = w + (b * kBlockN + n - start) * K + g * kGroup;
          for (int64_t kk = 0; kk < kGroup; ++kk) row[kk] = store<c10::BFloat16>(tile[kk][n]);
        }
      }
    }
  });
}

}  // namespace pagedllm_cpu
