"""GGUF Q4_0 / Q4_1 linear weights kept at 4 bits, multiplied by torch's int4 CPU kernel; GGUF
embedding tables kept as the file's blocks, looked up row by row.

llama.cpp's Q4 blocks cover 32 consecutive inputs of one output row (ggml-quants.h)::

    Q4_0 block, 18 bytes: d (f16) | 16 bytes of nibbles          w = d * (q - 8)
    Q4_1 block, 20 bytes: d (f16) | m (f16) | 16 bytes of nibbles  w = d * q + m

    nibbles: byte j holds q[j] in its low half and q[j + 16] in its high half.

``torch.ops.aten._weight_int4pack_mm_for_cpu`` computes with the same grouping: per group of 32
inputs and per output row, ``w = (q - 8) * scale + zero``. So a GGUF Q4 row maps onto it without
requantizing: ``scale = d`` and ``zero = m + 8 d`` (Q4_1) or ``0`` (Q4_0). The only rounding is
of the scales and zeros to bfloat16, the kernel's activation dtype (the kernel is 10-50x slower
with float32 activations on the CPU, so float32 runs cast the activations to bf16 around it).

Loading: the layer's ``weight`` becomes a uint8 ``[output_size, row_bytes]`` parameter holding the
file's raw blocks. Rows are whole blocks, so the layer's own weight loaders (row shards of
q/k/v and gate/up) and llama.cpp's q/k row permutation apply to them unchanged; after loading,
the rows are decoded and packed once (packing is not row-separable, so it waits for all shards).

An embedding table (Q8_0, Q4_0 or Q4_1) stays in the file's blocks too: a lookup dequantizes the
rows it reads, to exactly the values of the dequantized path (``dequantize_rows``), at a fraction
of the dense table's memory (Q8_0: 34 bytes per 32 values against 64 in bfloat16).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels.cpu import ops as cpu_ops
from pagedllm.kernels.cpu.build import available as cpu_kernels_available
from pagedllm.layers.quantization.base import EmbeddingMethod, LinearMethod
from pagedllm.layers.row_buckets import pad_rows

logger = logging.getLogger(__name__)

GROUP_SIZE = 32  # inputs per GGUF block and per group of the int4 kernel
# GGML type name -> bytes per block of 32 weights.
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20}
# GGML type name -> bytes per block of 32 values, of the types an embedding table is kept in
# (Q8_0 block: d (f16) | 32 int8 q, w = d * q).
EMBEDDING_BLOCK_BYTES = {**BLOCK_BYTES, "Q8_0": 34}
# The int4 kernel packs output rows in tiles of 16.
ROW_TILE = 16
_INNER_K_TILES = 2  # the packing's inner tiling (any of 2, 4, 8 is valid for K % 32 == 0)


def unsupported_reason(tensor_type: str, output_size: int, input_size: int) -> str | None:
    """Why a weight of this GGML type and shape cannot stay quantized here, or None if it can."""
    if tensor_type not in BLOCK_BYTES:
        return f"GGML type {tensor_type} has no quantized CPU kernel here (supported: {sorted(BLOCK_BYTES)})"
    if input_size % GROUP_SIZE or output_size % ROW_TILE:
        return f"shape [{output_size}, {input_size}] is not a multiple of [{ROW_TILE}, {GROUP_SIZE}]"
    return None


def decode_q4_blocks(raw: torch.Tensor, tensor_type: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """raw: uint8 [N, num_groups * block_bytes] -> (q int32 [N, K] in 0..15, scale and zero
    float32 [N, num_groups]) such that ``w = (q - 8) * scale + zero`` per group of 32."""
    num_rows = raw.shape[0]
    blocks = raw.view(num_rows, -1, BLOCK_BYTES[tensor_type])  # [N, groups, block_bytes]
    d = blocks[..., 0:2].contiguous().view(torch.float16).squeeze(-1).float()
    if tensor_type == "Q4_1":
        m = blocks[..., 2:4].contiguous().view(torch.float16).squeeze(-1).float()
        nibbles, zero = blocks[..., 4:], m + 8 * d
    else:
        nibbles, zero = blocks[..., 2:], torch.zeros_like(d)
    q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1)  # [N, groups, 32]: q[j], then q[j + 16]
    return q.reshape(num_rows, -1).int(), d, zero


class GGUFQ4LinearMethod(LinearMethod):
    """A GGUF Q4_0/Q4_1 weight, packed for ``_weight_int4pack_mm_for_cpu``."""

    def __init__(self, tensor_type: str) -> None:
        self.tensor_type = tensor_type

    def create_weights(self, layer: nn.Module) -> None:
        """Replace the layer's dense ``weight`` by a raw-block parameter with the same loader."""
        output_size, input_size = layer.weight.shape
        row_bytes = input_size // GROUP_SIZE * BLOCK_BYTES[self.tensor_type]
        loader = layer.weight.weight_loader
        raw = torch.empty(output_size, row_bytes, dtype=torch.uint8)
        layer.weight = nn.Parameter(raw, requires_grad=False)
        layer.weight.weight_loader = loader
        layer.input_size = input_size

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        packed, scales_and_zeros = pack_q4(layer.weight.data, self.tensor_type)
        del layer.weight
        layer.register_buffer("qweight", packed, persistent=False)
        layer.register_buffer("scales_and_zeros", scales_and_zeros, persistent=False)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = q4_matmul(x, layer.qweight, layer.scales_and_zeros)
        return out if bias is None else out.add_(bias)


# Rows decoded at a time by pack_q4: its int32 temporaries for a 49,152-row table would take
# 113 MB at once (the int4 packing of a row tile depends on that tile alone).
_PACK_CHUNK_ROWS = 4096


def pack_q4(raw: torch.Tensor, tensor_type: str) -> tuple[torch.Tensor, torch.Tensor]:
    """raw: uint8 [N, num_groups * block_bytes] of Q4_0/Q4_1 blocks -> (the int4 kernel's packed
    weight, its scales and zeros bf16 [num_groups, N, 2])."""
    packed, scales, zeros = [], [], []
    for start in range(0, raw.shape[0], _PACK_CHUNK_ROWS):
        q, scale, zero = decode_q4_blocks(raw[start : start + _PACK_CHUNK_ROWS], tensor_type)
        packed.append(torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, _INNER_K_TILES))
        scales.append(scale.to(torch.bfloat16))
        zeros.append(zero.to(torch.bfloat16))
    # [num_groups, N, 2]: the kernel's layout of (scale, zero) per group and output row.
    scales_and_zeros = torch.stack([torch.cat(scales).t(), torch.cat(zeros).t()], dim=-1).contiguous()
    return torch.cat(packed), scales_and_zeros


# Rows up to which pagedllm's own kernel (kernels/cpu/csrc/int4_matmul.cpp) multiplies: it streams
# the weight with prefetches, where torch's reads it cold at ~25 GB/s (one stream's 120 layer
# products of SmolLM2: 2.2 against 2.6 ms). Its cost grows with the rows, as torch's does.
FEW_ROWS = 4
FEW_ROWS_BLOCK_N = 64  # its blocks of outputs: the int4 packing's tile of 64 rows


# Rows from which a product decodes the weight a tile at a time into bf16 GEMMs (prefill, batches):
# torch's int4 kernel computes at a fraction of a bf16 GEMM's rate there, while decoding costs one
# pass over the weight per call, amortised over the rows. Below it the int4 kernels win, by reading
# a quarter of the bytes. From 128 rows either way (a ~1,000-token prompt: 61 against 181 prompt
# tok/s for the int4 kernel alone). The brgemm kernel already wins from 8 rows (SmolLM2's four
# products of a layer, one thread, benchmarks/q4_gemm.py: 1.0 against 1.2 ms at 8 rows, 1.4
# against 14 ms at 128), but it rounds differently from the int4 kernel, and short prompts sit on
# its numerics: the embedded model's first token for README's prompt is a one-ulp bf16 tie
# ("The", logprob -1.87, against "L", -1.99) that the int4 kernel's rounding breaks toward "The
# capital of France is Paris." and brgemm's toward "L'Étoile, la Marseillaise". Rows 8-127 keep
# the int4 kernel until a change of their numerics is judged on more than one prompt.
BRGEMM_MIN_ROWS = 128
DEQUANTIZE_MIN_ROWS = 128
# Weight values dequantized per tile (1 MB in float32): a tile stays in cache from its decoding to
# its GEMM, and a large model's layer never has a dense copy at once.
DEQUANTIZE_TILE_VALUES = 1 << 18


class TiledProduct(NamedTuple):
    """The product that decodes a Q4 weight a tile at a time into bf16 GEMMs, and the rows from
    which it beats torch's int4 kernel."""

    matmul: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    min_rows: int


@functools.cache
def tiled_product() -> TiledProduct:
    """Chosen once per process: where oneDNN's brgemm ukernel runs on AMX, the C++ kernel that
    decodes each tile straight into the micro-kernel's layout (``kernels/cpu/csrc/
    int4_prefill.cpp``: no reorder inside a GEMM, no transposing decode, no padded rows); else
    torch's bf16 mm on row-major tiles (``padded_dequantized_matmul``)."""
    if cpu_kernels_available() and cpu_ops.int4_prefill_supported():
        return TiledProduct(cpu_ops.int4_prefill_matmul, BRGEMM_MIN_ROWS)
    return TiledProduct(padded_dequantized_matmul, DEQUANTIZE_MIN_ROWS)


def q4_matmul(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """x [M, K] times a pack_q4 weight [N, K] transposed -> [M, N] in x's dtype."""
    x_bf16 = x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16)
    num_rows, blocked = x.shape[0], packed.shape[0] % FEW_ROWS_BLOCK_N == 0
    tiled = tiled_product()
    if num_rows <= FEW_ROWS and blocked and cpu_kernels_available():
        out = cpu_ops.int4_matmul_few_rows(x_bf16.contiguous(), packed, scales_and_zeros)
    elif num_rows >= tiled.min_rows and blocked:
        out = tiled.matmul(x_bf16.contiguous(), packed, scales_and_zeros)
    else:
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(x_bf16, packed, GROUP_SIZE, scales_and_zeros)
    return out if x.dtype == torch.bfloat16 else out.to(x.dtype)


def padded_dequantized_matmul(
    x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor
) -> torch.Tensor:
    """``dequantized_matmul`` with x's rows padded to a bucket: oneDNN, behind torch's bf16 mm,
    builds a primitive per shape (layers/row_buckets.py)."""
    return dequantized_matmul(pad_rows(x), packed, scales_and_zeros)[: x.shape[0]]


def dequantized_matmul(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """x bf16 [M, K] times a pack_q4 weight [N, K] (N a multiple of 64) transposed -> bf16 [M, N]:
    the weight dequantized a tile of output rows at a time (``dequantize_packed``), each tile one
    bf16 GEMM. Reads the 4-bit weight once per call and does 2 M N K FLOPs at the GEMM's rate."""
    num_outputs, input_size = packed.shape[0], x.shape[1]
    tile = max(1, DEQUANTIZE_TILE_VALUES // (input_size * FEW_ROWS_BLOCK_N)) * FEW_ROWS_BLOCK_N
    # The C++ kernel decodes in one pass; the torch formulation takes about eight (0.85 s of a
    # 1,000-token prompt's 5.7 s with SmolLM2, one thread).
    dequantize = cpu_ops.int4_dequantize if cpu_kernels_available() else dequantize_packed
    out = torch.empty(x.shape[0], num_outputs, dtype=torch.bfloat16)
    for start in range(0, num_outputs, tile):
        weight = dequantize(packed, scales_and_zeros, start, min(start + tile, num_outputs))
        torch.mm(x, weight.t(), out=out[:, start : start + weight.shape[0]])
    return out


def dequantize_packed(
    packed: torch.Tensor, scales_and_zeros: torch.Tensor, start: int, end: int
) -> torch.Tensor:
    """Output rows [start, end) (multiples of 64) of a pack_q4 weight as bf16 [end - start, K]:
    ``w = (q - 8) * scale + zero`` in float32, as the int4 kernels compute it. The PyTorch
    formulation of ``kernels.cpu.ops.int4_dequantize``, where the CPU kernels do not build.

    The packing (kernels/cpu/csrc/int4_matmul.cpp): uint8 [N / 64, K, 32], byte j of input k of
    block b holding q[64 b + j, k] in its low nibble and q[64 b + 32 + j, k] in its high one."""
    input_size = packed.numel() * 2 // packed.shape[0]
    blocks = packed.view(-1, input_size, 32)[start // 64 : end // 64]  # [B, K, 32]
    q = torch.cat([blocks & 0x0F, blocks >> 4], dim=-1)  # [B, K, 64]: q[64 b + r, k] at [b, k, r]
    q = q.transpose(1, 2).reshape(end - start, input_size // GROUP_SIZE, GROUP_SIZE)
    pairs = scales_and_zeros[:, start:end].transpose(0, 1).float()  # [rows, groups, 2]
    scale, zero = pairs[..., :1], pairs[..., 1:]
    # q * scale + (zero - 8 scale), in float32 as the kernels compute, rounded once to bf16. (A
    # bf16 or mixed-dtype addcmul does it in one pass, but broadcasting a scale over each group's 32
    # values defeats its vectorisation: slower, measured.)
    weight = q.float().mul_(scale).add_(zero - 8 * scale)
    return weight.view(end - start, input_size).to(torch.bfloat16)


def dequantize_rows(raw: torch.Tensor, tensor_type: str) -> torch.Tensor:
    """raw: uint8 [N, num_groups * block_bytes] of a type in ``EMBEDDING_BLOCK_BYTES`` -> float32
    [N, K], bit for bit what ``gguf.quants.dequantize`` gives (the same float32 operations in the
    same order), so a table kept quantized reads the values the dequantized path loads."""
    num_rows = raw.shape[0]
    blocks = raw.view(num_rows, -1, EMBEDDING_BLOCK_BYTES[tensor_type])  # [N, groups, block_bytes]
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()  # [N, groups, 1]
    if tensor_type == "Q8_0":
        q = blocks[..., 2:].contiguous().view(torch.int8).float()
        return (q * d).view(num_rows, -1)
    # Not decode_q4_blocks' (q - 8) * d + zero: gguf multiplies d by (q - 8), whose zero takes d's
    # sign (-0.0), and the table must be gguf's to the bit.
    nibbles = blocks[..., 4:] if tensor_type == "Q4_1" else blocks[..., 2:]
    q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1)  # [N, groups, 32]: q[j], then q[j + 16]
    if tensor_type == "Q4_0":
        return (d * (q.to(torch.int8) - 8).float()).view(num_rows, -1)
    m = blocks[..., 2:4].contiguous().view(torch.float16).float()
    return (d * q.float() + m).view(num_rows, -1)


class GGUFEmbeddingMethod(EmbeddingMethod):
    """A GGUF embedding table kept as the file's blocks: ``weight`` is uint8 [num_rows, row_bytes].

    As a tied LM head without a blocked copy of its own (``OneDNNTiedLMHeadMethod`` on the CPU),
    ``apply`` dequantizes the whole table at every call: correct, not fast.
    """

    # Values dequantized at a time by ``dequantize`` (1 MB of float32): temporaries this small are
    # served from the heap's free space, where chunks of 4096 rows grew the heap by ~60 MB (SmolLM2's
    # table, measured), which glibc keeps resident once they are freed.
    DEQUANTIZE_CHUNK_VALUES = 1 << 18

    def __init__(self, tensor_type: str) -> None:
        self.tensor_type = tensor_type

    def create_weights(self, layer: nn.Module) -> None:
        """Replace the layer's dense ``weight`` by a raw-block parameter with the same loader (the
        layer's row sharding and padding apply to whole rows of blocks unchanged)."""
        num_rows, embedding_dim = layer.weight.shape
        row_bytes = embedding_dim // GROUP_SIZE * EMBEDDING_BLOCK_BYTES[self.tensor_type]
        loader = layer.weight.weight_loader
        layer.params_dtype = layer.weight.dtype
        layer.weight = nn.Parameter(torch.empty(num_rows, row_bytes, dtype=torch.uint8), requires_grad=False)
        layer.weight.weight_loader = loader

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Nothing: lookups read the blocks as loaded."""

    def embedding(self, layer: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        rows = dequantize_rows(layer.weight[input_ids.reshape(-1)], self.tensor_type)
        return rows.to(layer.params_dtype).view(*input_ids.shape, -1)

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        raw = layer.weight.data
        embedding_dim = raw.shape[1] // EMBEDDING_BLOCK_BYTES[self.tensor_type] * GROUP_SIZE
        chunk = max(1, self.DEQUANTIZE_CHUNK_VALUES // embedding_dim)
        table = torch.empty(raw.shape[0], embedding_dim, dtype=layer.params_dtype)
        for start in range(0, raw.shape[0], chunk):
            table[start : start + chunk] = dequantize_rows(raw[start : start + chunk], self.tensor_type)
        return table

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, self.dequantize(layer), bias)
