"""A lean GGUF reader: the file's scalar metadata and tensor table, tensors as memory-map views.

``gguf.GGUFReader`` builds a numpy view per part of every metadata value, so a 49k-token
vocabulary costs seconds and ~300 MB of resident memory before any weight is read. The model
needs only the scalars (config), the lengths of arrays (vocabulary size) and the tensor table, so
this reader steps over array items without keeping them. The tokenizer is converted (and cached)
by transformers from the same file, separately.

Layout (GGUF v2/v3, ggml's docs/gguf.md), little-endian::

    magic "GGUF" | version u32 | tensor_count u64 | kv_count u64
    kv_count x   key (u64 length + utf-8) | value_type u32 | value
    tensor_count x name | n_dims u32 | ne[n_dims] u64 (innermost first) | ggml_type u32 | offset u64
    padding to ``general.alignment`` (32) | tensor data (offsets relative to here)
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np

# GGUF value type -> struct format of its scalar (8: string, 9: array are handled apart).
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
# Items of a numeric array that a size-only read still keeps (e.g. per-layer head counts).
_MAX_KEPT_ITEMS = 1024


@dataclass
class GGUFTensor:
    name: str
    tensor_type: gguf.GGMLQuantizationType
    # PyTorch's shape order (outermost first); quantized types: uint8 [..., row_bytes].
    data: np.ndarray


class GGUFFile:
    """``fields``: scalar and string metadata, and numeric arrays up to 1024 items;
    ``array_lengths``: the length of every array; ``tensors``: the tensor table, in file order."""

    def __init__(self, path: str) -> None:
        # struct reads on an mmap (not a numpy memmap, ~20x slower per read) for the header walk.
        with open(path, "rb") as f:
            self._buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._data = np.memmap(path, mode="r")
        self._pos = 0
        self.fields: dict[str, Any] = {}
        self.array_lengths: dict[str, int] = {}
        magic, version, tensor_count, kv_count = self._read("<4sIQQ")
        if magic != b"GGUF" or version < 2:
            raise ValueError(f"{path!r} is not a GGUF v2+ file (magic {magic!r}, version {version})")
        for _ in range(kv_count):
            key = self._string()
            self._read_value(key, self._read("<I")[0])
        infos = [self._tensor_info() for _ in range(tensor_count)]
        alignment = int(self.fields.get("general.alignment", 32))
        data_start = -(-self._pos // alignment) * alignment
        self.tensors = [self._tensor(data_start, *info) for info in infos]

    def _read(self, fmt: str) -> tuple[Any, ...]:
        values = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        (length,) = self._read("<Q")
        self._pos += length
        return self._buf[self._pos - length : self._pos].decode("utf-8")

    def _read_value(self, key: str, value_type: int) -> None:
        if value_type == _STRING:
            self.fields[key] = self._string()
        elif value_type in _SCALARS:
            self.fields[key] = self._read("<" + _SCALARS[value_type])[0]
        elif value_type == _ARRAY:
            item_type, length = self._read("<IQ")
            self.array_lengths[key] = length
            if item_type == _STRING:
                for _ in range(length):  # step over each length-prefixed string
                    self._pos += 8 + struct.unpack_from("<Q", self._buf, self._pos)[0]
            elif item_type in _SCALARS:
                fmt = "<" + _SCALARS[item_type] * length
                if length <= _MAX_KEPT_ITEMS:
                    self.fields[key] = list(self._read(fmt))
                else:
                    self._pos += struct.calcsize(fmt)
            else:
                raise ValueError(f"GGUF array {key!r} has item type {item_type}, which cannot be skipped")
        else:
            raise ValueError(f"GGUF metadata {key!r} has unknown value type {value_type}")

    def _tensor_info(self) -> tuple[str, list[int], int, int]:
        name = self._string()
        (n_dims,) = self._read("<I")
        dims = list(self._read(f"<{n_dims}Q"))
        ggml_type, offset = self._read("<IQ")
        return name, dims, ggml_type, offset

    def _tensor(self, data_start: int, name: str, dims: list[int], ggml_type: int, offset: int) -> GGUFTensor:
        tensor_type = gguf.GGMLQuantizationType(ggml_type)
        block_size, type_size = gguf.GGML_QUANT_SIZES[tensor_type]
        shape = dims[::-1]  # ggml lists the innermost dimension first
        shape[-1] = shape[-1] // block_size * type_size
        num_bytes = int(np.prod(shape))
        raw = self._data[data_start + offset : data_start + offset + num_bytes]
        if block_size == 1:  # plain F32/F16/BF16...: typed elements
            dtype = {gguf.GGMLQuantizationType.F32: np.float32, gguf.GGMLQuantizationType.F16: np.float16}
            if tensor_type in dtype:
                shape[-1] //= type_size
                return GGUFTensor(name, tensor_type, raw.view(dtype[tensor_type]).reshape(shape))
        return GGUFTensor(name, tensor_type, raw.reshape(shape))
