"""Compile, for Hopper (sm_90), every Triton kernel launch that the kernel wrappers make on small
CPU tensors, without a GPU: ``JITFunction.run`` is replaced by a compile (nothing launches).

Run as a script, without TRITON_INTERPRET (the interpreter would run the kernels as Python, which
is what this check looks past): ``python tests/kernels/sm90_compile.py``. Prints one line per
distinct compiled launch and exits non-zero on the first compile error.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

assert os.environ.get("TRITON_INTERPRET") != "1", "run without TRITON_INTERPRET"

_DTYPES = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "i1",
    torch.float8_e4m3fn: "fp8e4nv",
}
_TARGET = GPUTarget("cuda", 90, 32)
compiled: set[tuple] = set()


def _arg_type(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + _DTYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(value).__name__}")


def compile_instead(self: JITFunction, *args: object, grid: object, warmup: bool, **kwargs: object) -> None:
    options = {
        key: kwargs.pop(key)
        for key in ("num_warps", "num_stages", "launch_pdl", "enable_fp_fusion")
        if key in kwargs
    }
    values = dict(zip([p.name for p in self.params], args))
    values.update(kwargs)
    signature, constexprs = {}, {}
    for index, param in enumerate(self.params):
        value = values.get(param.name, param.default)
        if param.is_constexpr or value is None:
            signature[param.name] = "constexpr"
            constexprs[(index,)] = value
        else:
            signature[param.name] = _arg_type(value)
    key = (self.fn.__name__, *signature.items(), *sorted(constexprs.items()), *options.items())
    if key in compiled:
        return
    triton.compile(ASTSource(self, signature, constexprs), target=_TARGET, options=options)
    compiled.add(key)
    named = sorted((self.params[index].name, value) for (index,), value in constexprs.items())
    print(f"compiled {self.fn.__name__} {options} {named}")


def main() -> None:
    JITFunction.run = compile_instead
    # The launches a Hopper GPU makes: with programmatic dependent launch (the tensors here are on
    # the CPU, where the wrappers turn it off).
    import pagedllm.kernels.triton.pdl as pdl

    hopper = dataclasses.replace(pdl.platform_for(torch.device("cpu")), device_capability=(9, 0))
    pdl.platform_for = lambda device: hopper
    import sm90_launches  # beside this script (sys.path[0])

    for launch in sm90_launches.LAUNCHES:
        launch()
    print(f"{len(compiled)} launches compiled for sm_90")


if __name__ == "__main__":
    # The source tree's pagedllm, after this script's directory.
    sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    main()
