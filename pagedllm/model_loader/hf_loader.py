"""Weights of a Hugging Face model directory: ``*.safetensors``, sharded or not.

Pickle checkpoints (``.bin``, ``.pt``, ``.pth``) are refused: unpickling runs arbitrary code from
the file, and safetensors holds the same tensors without that risk.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator

from safetensors import SafetensorError, safe_open

from pagedllm.layers.utils import CheckpointSlice

SAFETENSORS_INDEX = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth")


def find_safetensors_files(model_dir: str) -> list[str]:
    """The directory's safetensors files: those its index names, or every ``*.safetensors``."""
    index_path = os.path.join(model_dir, SAFETENSORS_INDEX)
    if os.path.isfile(index_path):
        with open(index_path) as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        files = [os.path.join(model_dir, name) for name in sorted(set(weight_map.values()))]
        absent = [path for path in files if not os.path.isfile(path)]
        if absent:
            raise ValueError(f"{SAFETENSORS_INDEX} in {model_dir!r} names missing files: {absent}")
        return files
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if files:
        return files
    pickles = sorted(name for name in os.listdir(model_dir) if name.endswith(PICKLE_SUFFIXES))
    if pickles:
        raise ValueError(
            f"{model_dir!r} holds only pickle checkpoints ({', '.join(pickles)}), which are refused because "
            "loading them can run arbitrary code; convert them to safetensors "
            "(e.g. model.save_pretrained(dir, safe_serialization=True))"
        )
    raise ValueError(f"no *.safetensors weights in {model_dir!r}")


def safetensors_names(model_dir: str) -> list[str]:
    """The checkpoint's tensor names, from its index or the files' headers (no tensor is read)."""
    index_path = os.path.join(model_dir, SAFETENSORS_INDEX)
    if os.path.isfile(index_path):
        with open(index_path) as f:
            return list(json.load(f)["weight_map"])
    names = []
    for path in find_safetensors_files(model_dir):
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                names += f.keys()
        except (OSError, RuntimeError, SafetensorError) as e:
            raise ValueError(f"cannot read the weights file {path!r}: {e}") from e
    return names


def iterate_safetensors_weights(model_dir: str) -> Iterator[tuple[str, CheckpointSlice]]:
    """(Hugging Face name, unread CheckpointSlice) of every checkpoint tensor, one at a time: the
    weight loaders narrow each to this rank's shard, and only that region is read from the file
    (safetensors' ``get_slice``), so a tensor-parallel rank never reads the whole tensor. Each
    slice must be used before the next one is drawn (its file is closed after its last tensor)."""
    for path in find_safetensors_files(model_dir):
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                    tensor_slice = f.get_slice(name)
                    yield name, CheckpointSlice(tuple(tensor_slice.get_shape()), tensor_slice.__getitem__)
        except (OSError, RuntimeError, SafetensorError) as e:
            # safetensors' own errors (a truncated or corrupt header) name no file.
            raise ValueError(f"cannot read the weights file {path!r}: {e}") from e
