"""Decode attention bandwidth (benchmarks/README.md, K1): paged implementations against SDPA on a
contiguous cache and against a plain copy, on CUDA.

Decode reads every cached K/V element once and does ~2 * num_queries_per_kv FLOPs per byte, so its
figure of merit is achieved bandwidth: bytes of K/V (plus the small query and output) over the
median time of ``triton.testing.do_bench`` (which flushes L2 before each run) replaying the launch
from a CUDA graph, so that the host's launch work is not timed. On the same K/V:

- the ceiling: a device-to-device copy of as many bytes, counting read + write;
- the bar: torch's SDPA with each sequence's K/V contiguous and each GQA group's query heads as its
  queries (so K/V are read once, as the paged kernels read them). A batch of equal contexts is
  dense ``[num_seqs, num_kv_heads, context_len, head_size]``; a ragged one is a jagged nested tensor,
  which SDPA runs through flash-attention's varlen kernel. Only the fused backends are allowed
  (flash, else memory-efficient for float32), so a silent fallback to the math backend cannot
  pass for the bar.

With ``DecodeShape.sliding_window`` the same measure covers windowed decode (Mistral, Gemma's local
layers): the kernel should read only the window's blocks, so its bytes are the window's and the
bar is SDPA over each sequence's last ``sliding_window`` tokens.

Each implementation is one entry of ``DECODE_IMPLS``: a function with ``paged_decode``'s arguments,
the cache layout it reads (converted from the Triton layout), the launch parameters the engine
uses, and those ``pagedllm bench kernels --sweep`` tries. Adding a kernel (the CUDA PagedAttention
V1/V2) is adding an entry. Kernels are imported lazily: listing the entries needs only torch.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

# fn(query, key_cache, value_cache, block_tables, seq_lens, scale, max_seq_len, out, **launch) writes
# out. query, out: [num_seqs, num_heads, head_size]; block_tables: [num_seqs, max_blocks] int32;
# seq_lens: [num_seqs] int32; the caches in the implementation's own layout.
DecodeFn = Callable[..., object]
# (key_cache, value_cache) in the Triton layout [num_blocks, num_kv_heads, block_size, head_size]
# -> the same caches in the layout an implementation reads.
CacheLayout = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class DecodeShape:
    """One decode batch: a single new query token per sequence over its cached context."""

    seq_lens: tuple[int, ...]
    num_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int
    dtype: torch.dtype
    # Each query sees its context's last sliding_window tokens (None: all of them).
    sliding_window: int | None = None
    # The cache's element type (None: ``dtype``); torch.float8_e4m3fn is kv_cache_dtype="fp8".
    kv_dtype: torch.dtype | None = None

    @property
    def cache_dtype(self) -> torch.dtype:
        return self.dtype if self.kv_dtype is None else self.kv_dtype

    @property
    def attended_lens(self) -> tuple[int, ...]:
        """Tokens each query attends to: the context, or its last sliding_window tokens."""
        window = self.sliding_window
        return self.seq_lens if window is None else tuple(min(n, window) for n in self.seq_lens)

    @property
    def bytes_moved(self) -> int:
        """Every attended K/V element read once, the query read and the output written once (a
        windowed kernel that reads only the window's blocks moves these bytes, plus at most one
        partial block per sequence)."""
        kv_elements = 2 * sum(self.attended_lens) * self.num_kv_heads * self.head_size
        query_out_elements = 2 * len(self.seq_lens) * self.num_heads * self.head_size
        return kv_elements * self.cache_dtype.itemsize + query_out_elements * self.dtype.itemsize


@dataclass(frozen=True)
class DecodeImpl:
    """A paged decode implementation, as the benchmark runs it."""

    load: Callable[[], DecodeFn]  # imports the kernel
    cache_layout: CacheLayout
    default_launch: Callable[[DecodeShape], dict[str, int]]  # what the engine launches
    sweep_space: Mapping[str, tuple[int, ...]]  # --sweep tries every combination; {}: nothing to tune
    supports_sliding_window: bool = False  # takes sliding_window= (DecodeShape.sliding_window)
    supports_fp8_cache: bool = False  # reads float8_e4m3fn caches with k_scale=/v_scale=
    package: str | None = None  # a peer's package, timed only where it is installed

    @property
    def available(self) -> bool:
        return self.package is None or importlib.util.find_spec(self.package) is not None

    def launches(self, shape: DecodeShape, sweep: bool) -> list[dict[str, int]]:
        """The launch parameters to time: the engine's, then (with ``sweep``) every other combination."""
        default = self.default_launch(shape)
        if not sweep or not self.sweep_space:
            return [default]
        grid = [
            dict(zip(self.sweep_space, values)) for values in itertools.product(*self.sweep_space.values())
        ]
        return [default, *(launch for launch in grid if launch != default)]


def _load_triton() -> DecodeFn:
    from pagedllm.kernels.triton import paged_decode

    return paged_decode


def _triton_default_launch(shape: DecodeShape) -> dict[str, int]:
    """The backend's launch: the table's, with the partition sized for this batch (and window)."""
    from pagedllm.kernels.triton.launch import decode_partition_size, default_launches

    launch = dataclasses.asdict(default_launches(shape.head_size, shape.dtype)[0])
    # Without a GPU (listing launches, tests) the rule has no SMs to count: the table's stands.
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    launch["partition_size"] = decode_partition_size(
        len(shape.seq_lens),
        shape.num_kv_heads,
        max(shape.attended_lens),
        launch,
        device,
        min_seq_len=min(shape.attended_lens),
    )
    return launch


def _triton_layout(key_cache: torch.Tensor, value_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return key_cache, value_cache


def _load_cuda_v1() -> DecodeFn:
    from pagedllm.kernels.cuda import paged_attention_v1

    return paged_attention_v1


def _load_cuda_v2() -> DecodeFn:
    from pagedllm.kernels.cuda import paged_attention_v2

    return paged_attention_v2


def _cuda_layout(key_cache: torch.Tensor, value_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's original layout: K [blocks, kv_heads, head_size / x, block_size, x], V [.., head_size, bs]."""
    from pagedllm.kernels.cuda.layout import from_triton_layout

    return from_triton_layout(key_cache, value_cache)


def _no_launch_parameters(shape: DecodeShape) -> dict[str, int]:
    return {}


def _load_flashinfer() -> DecodeFn:
    """FlashInfer's paged batch decode (the peer vLLM and SGLang use), on the Triton layout itself
    (FlashInfer's ``HND``: [pages, kv_heads, page_size, head_size]). Its ``plan`` (host work: page
    lists, split sizes) runs once per batch, on the first call, as an engine plans once per step
    for every layer; the timed call is ``run``."""
    import flashinfer

    planned: dict[str, Any] = {}

    def decode(
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        max_seq_len: int,
        out: torch.Tensor,
        use_tensor_cores: int = 0,
    ) -> None:
        key = (block_tables.data_ptr(), seq_lens.data_ptr(), use_tensor_cores)
        if planned.get("key") != key:
            block_size = key_cache.shape[2]
            lens = seq_lens.tolist()
            pages = [-(-n // block_size) for n in lens]
            device = query.device
            workspace = torch.zeros(128 * 2**20, dtype=torch.uint8, device=device)
            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                workspace, kv_layout="HND", use_tensor_cores=bool(use_tensor_cores)
            )
            wrapper.plan(
                torch.tensor([0, *itertools.accumulate(pages)], dtype=torch.int32, device=device),
                torch.cat([block_tables[i, :n] for i, n in enumerate(pages)]).to(torch.int32),
                torch.tensor(
                    [n - (p - 1) * block_size for n, p in zip(lens, pages)], dtype=torch.int32, device=device
                ),
                query.shape[1],
                key_cache.shape[1],
                query.shape[2],
                block_size,
                q_data_type=query.dtype,
                kv_data_type=key_cache.dtype,
                sm_scale=scale,
            )
            planned.update(key=key, wrapper=wrapper)
        planned["wrapper"].run(query, (key_cache, value_cache), out=out)

    return decode


def _flashinfer_launch(use_tensor_cores: bool) -> Callable[[DecodeShape], dict[str, int]]:
    def launch(shape: DecodeShape) -> dict[str, int]:
        return {"use_tensor_cores": int(use_tensor_cores)}

    return launch


DECODE_IMPLS: dict[str, DecodeImpl] = {
    "triton": DecodeImpl(
        load=_load_triton,
        cache_layout=_triton_layout,
        default_launch=_triton_default_launch,
        sweep_space={
            "partition_size": (128, 256, 512, 1024, 2048, 4096),
            "block_n": (32, 64, 128),
            "num_warps": (4, 8),
            "num_stages": (2, 3),
        },
        supports_sliding_window=True,
        supports_fp8_cache=True,
    ),
    # vLLM's original kernels: their thread-group layout is fixed by the block size; nothing to sweep.
    "cuda-v1": DecodeImpl(_load_cuda_v1, _cuda_layout, _no_launch_parameters, {}),
    "cuda-v2": DecodeImpl(_load_cuda_v2, _cuda_layout, _no_launch_parameters, {}),
    # Peers, not engine paths: need the flashinfer package (JIT-compiled on first use). Its two
    # decodes are two entries, so that every run times both and the bar is the faster: the
    # CUDA-core one (vLLM's pick for GQA groups of up to 4 query heads) and the tensor-core one.
    "flashinfer": DecodeImpl(
        _load_flashinfer, _triton_layout, _flashinfer_launch(False), {}, package="flashinfer"
    ),
    "flashinfer-tc": DecodeImpl(
        _load_flashinfer, _triton_layout, _flashinfer_launch(True), {}, package="flashinfer"
    ),
}


@dataclass
class DecodeInputs:
    """A random decode batch on a device, its cache in the Triton layout. Each sequence's blocks
    come from one random permutation of the cache, as a long-running cache ends up. An FP8 cache
    holds the random values rounded to float8_e4m3fn with unit scales (``k_scale``/``v_scale``)."""

    shape: DecodeShape
    query: torch.Tensor  # [num_seqs, num_heads, head_size]
    key_cache: torch.Tensor  # [num_blocks, num_kv_heads, block_size, head_size]
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with block 0
    seq_lens: torch.Tensor  # [num_seqs] int32
    k_scale: torch.Tensor | None = None  # [] float32, with an FP8 cache
    v_scale: torch.Tensor | None = None

    @classmethod
    def random(cls, shape: DecodeShape, device: torch.device, seed: int) -> DecodeInputs:
        gen = torch.Generator(device=device).manual_seed(seed)
        blocks_per_seq = [-(-n // shape.block_size) for n in shape.seq_lens]
        cache_shape = (sum(blocks_per_seq), shape.num_kv_heads, shape.block_size, shape.head_size)
        key_cache, value_cache = (
            torch.randn(cache_shape, generator=gen, device=device, dtype=shape.dtype) for _ in range(2)
        )
        perm = torch.randperm(cache_shape[0], generator=gen, device=device).to(torch.int32)
        block_tables = torch.zeros(len(shape.seq_lens), max(blocks_per_seq), dtype=torch.int32, device=device)
        for table, blocks in zip(block_tables, perm.split(blocks_per_seq)):
            table[: len(blocks)] = blocks
        num_seqs = len(shape.seq_lens)
        query = torch.randn(
            num_seqs, shape.num_heads, shape.head_size, generator=gen, device=device, dtype=shape.dtype
        )
        seq_lens = torch.tensor(shape.seq_lens, dtype=torch.int32, device=device)
        if shape.cache_dtype == shape.dtype:
            return cls(shape, query, key_cache, value_cache, block_tables, seq_lens)
        unit = torch.ones((), dtype=torch.float32, device=device)
        key_cache, value_cache = (cache.to(shape.cache_dtype) for cache in (key_cache, value_cache))
        return cls(shape, query, key_cache, value_cache, block_tables, seq_lens, unit, unit.clone())

    def reference_caches(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The caches as the reference reads them: an FP8 cache dequantized to the query's dtype."""
        scales = (self.k_scale, self.v_scale)
        if scales[0] is None:
            return self.key_cache, self.value_cache
        return tuple(  # type: ignore[return-value]
            (cache.to(torch.float32) * scale).to(self.shape.dtype)
            for cache, scale in zip((self.key_cache, self.value_cache), scales)
        )

    @property
    def scale(self) -> float:
        return self.shape.head_size**-0.5


class ContiguousSdpa:
    """SDPA over copies of the batch's K/V with each sequence's tokens contiguous (the bar).

    Calling it runs only ``scaled_dot_product_attention``, which is what gets timed; ``heads``
    turns its output into the paged kernels' ``[num_seqs, num_heads, head_size]``.
    """

    def __init__(self, inputs: DecodeInputs) -> None:
        shape = inputs.shape
        num_seqs, group = len(shape.seq_lens), shape.num_heads // shape.num_kv_heads
        self.num_seqs, self.scale = num_seqs, inputs.scale
        # [num_seqs, num_kv_heads, group, head_size]: query head h is KV head h // group's row h % group.
        query = inputs.query.view(num_seqs, shape.num_kv_heads, group, shape.head_size)
        # [sum(attended_lens), num_kv_heads, head_size] each: token-major, flash-attention's own
        # layout; with a window, only its tokens (the windowed bar attends to exactly those).
        attended = shape.attended_lens
        self.ragged = len(set(attended)) > 1
        keys, values = (
            _packed_context(cache, inputs.block_tables, shape.seq_lens, attended)
            for cache in inputs.reference_caches()
        )
        if self.ragged:
            token_major = query.transpose(1, 2).reshape(-1, shape.num_kv_heads, shape.head_size)
            self.query = _jagged(token_major, [group] * num_seqs)
            self.key, self.value = (_jagged(t, attended) for t in (keys, values))
        else:
            self.query = query
            self.key, self.value = (
                t.view(num_seqs, attended[0], shape.num_kv_heads, shape.head_size).transpose(1, 2)
                for t in (keys, values)
            )

    def __call__(self) -> torch.Tensor:
        return F.scaled_dot_product_attention(self.query, self.key, self.value, scale=self.scale)

    def heads(self, out: torch.Tensor) -> torch.Tensor:
        """The output of a call as [num_seqs, num_heads, head_size]."""
        if self.ragged:
            # [num_seqs, num_kv_heads, {group}, head_size] jagged -> [num_seqs, group, num_kv_heads, ...].
            out = out.transpose(1, 2).values().unflatten(0, (self.num_seqs, -1)).transpose(1, 2)
        return out.flatten(1, 2)


def _packed_context(
    cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: Sequence[int], attended_lens: Sequence[int]
) -> torch.Tensor:
    """[num_blocks, num_kv_heads, block_size, head_size] paged -> [sum(attended_lens), num_kv_heads,
    head_size]: each sequence's last attended_lens tokens, one sequence after another."""
    num_kv_heads, block_size, head_size = cache.shape[1:]
    parts = []
    for table, seq_len, attended in zip(block_tables, seq_lens, attended_lens):
        blocks = cache[table[: -(-seq_len // block_size)].long()]  # [blocks, kv_heads, block_size, d]
        parts.append(
            blocks.transpose(1, 2).reshape(-1, num_kv_heads, head_size)[seq_len - attended : seq_len]
        )
    return torch.cat(parts)


def _jagged(values: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
    """[sum(lengths), num_kv_heads, head_size] -> jagged [len(lengths), num_kv_heads, {length},
    head_size]. The bounds are given so SDPA never reads them back from the device."""
    offsets = torch.tensor([0, *itertools.accumulate(lengths)], device=values.device)
    nested = torch.nested.nested_tensor_from_jagged(
        values, offsets, min_seqlen=min(lengths), max_seqlen=max(lengths)
    )
    return nested.transpose(1, 2)


@dataclass(frozen=True)
class DecodeResult:
    """One implementation at one launch on one batch, beside the references on the same K/V."""

    implementation: str
    launch: dict[str, int]
    median_ms: float
    gbps: float
    copy_gbps: float  # (read + write) bandwidth of copying bytes_moved bytes
    sdpa_ms: float
    sdpa_gbps: float
    rel_err: float  # ||out - sdpa|| / ||sdpa||: the two compute the same attention

    @property
    def fraction_of_copy(self) -> float:
        return self.gbps / self.copy_gbps

    @property
    def vs_sdpa(self) -> float:
        """Above 1: faster than SDPA on the contiguous cache."""
        return self.gbps / self.sdpa_gbps


def bench_decode(
    shape: DecodeShape, runs: Mapping[str, Sequence[dict[str, int]]], seed: int = 0
) -> list[DecodeResult]:
    """Time each implementation of ``runs`` (name in DECODE_IMPLS -> the launches to try) on one
    random batch of ``shape`` on the current CUDA device, with the copy and SDPA references
    measured once for all of them. Launches that do not fit the device are logged and skipped."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if shape.sliding_window is not None:
        unsupported = [name for name in runs if not DECODE_IMPLS[name].supports_sliding_window]
        if unsupported:
            raise ValueError(f"sliding_window: implementations {unsupported} take no window")
    if shape.cache_dtype != shape.dtype:
        unsupported = [name for name in runs if not DECODE_IMPLS[name].supports_fp8_cache]
        if unsupported:
            raise ValueError(f"kv_cache_dtype: implementations {unsupported} read no FP8 cache")
    inputs = DecodeInputs.random(shape, torch.device("cuda"), seed)
    sdpa = ContiguousSdpa(inputs)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        reference = sdpa.heads(sdpa()).float()
        sdpa_ms = _median_ms(sdpa)
    del sdpa  # its contiguous copies of K/V: as large as the cache
    copy_ms = _copy_ms(shape.bytes_moved)

    results = []
    for name, launches in runs.items():
        impl = DECODE_IMPLS[name]
        fn, caches = impl.load(), impl.cache_layout(inputs.key_cache, inputs.value_cache)
        for launch in launches:
            timed = _time_launch(fn, caches, inputs, reference, launch)
            if timed is None:
                continue
            median_ms, rel_err = timed
            results.append(
                DecodeResult(
                    implementation=name,
                    launch=launch,
                    median_ms=median_ms,
                    gbps=_gbps(shape.bytes_moved, median_ms),
                    copy_gbps=_gbps(2 * shape.bytes_moved, copy_ms),
                    sdpa_ms=sdpa_ms,
                    sdpa_gbps=_gbps(shape.bytes_moved, sdpa_ms),
                    rel_err=rel_err,
                )
            )
    return results


def _time_launch(
    fn: DecodeFn,
    caches: tuple[torch.Tensor, torch.Tensor],
    inputs: DecodeInputs,
    reference: torch.Tensor,
    launch: dict[str, int],
) -> tuple[float, float] | None:
    """(median ms, relative error against ``reference``) of one launch, or None where the launch
    does not fit the device (too much shared memory, too many registers)."""
    from triton.runtime.errors import OutOfResources, PTXASError

    # Poisoned: an element the kernel leaves unwritten makes the error NaN.
    out = torch.full_like(inputs.query, float("nan"))
    max_seq_len = max(inputs.shape.seq_lens)
    window = inputs.shape.sliding_window
    variants: dict[str, Any] = {} if window is None else {"sliding_window": window}
    if inputs.k_scale is not None:
        variants.update(k_scale=inputs.k_scale, v_scale=inputs.v_scale)

    def call() -> None:
        fn(
            inputs.query,
            *caches,
            inputs.block_tables,
            inputs.seq_lens,
            inputs.scale,
            max_seq_len,
            out,
            **variants,
            **launch,
        )

    try:
        call()  # compiles, outside the timing
    except (OutOfResources, PTXASError) as e:
        logger.warning("launch %s does not fit this device, skipped: %s", launch, e)
        return None
    rel_err = float((out.float() - reference).norm() / reference.norm())
    return _median_ms(call), rel_err


def _median_ms(fn: Callable[[], object]) -> float:
    """Median device time of ``fn``, replayed from a CUDA graph where it can be captured (as the
    engine's decode steps are): ``do_bench`` times from an event recorded after its L2 flush, so a
    launch whose host work outlasts the flush (a windowed decode reading a few MB, behind Python
    checks and three allocations) would be timed at the host's speed, not the kernel's."""
    import triton.testing

    fn()  # warm: allocator and compiled kernels ready before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except RuntimeError as e:  # not capturable (a host sync inside): time it eagerly
        logger.info("timing eagerly, no CUDA graph: %s", e)
        return triton.testing.do_bench(fn, return_mode="median")
    return triton.testing.do_bench(graph.replay, return_mode="median")


def graph_median_us(calls: Sequence[Callable[[], object]], repeats: int = 20) -> float:
    """Median device microseconds per call of ``calls`` run back to back, as a decode step runs its
    launches: each called once on a side stream (compiles, allocations), then all captured in one
    CUDA graph, whose replays are timed with events. Calls that read different tensors (a layer's
    weight copies larger together than L2) time reads from HBM."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return 1000 * sorted(times)[repeats // 2] / len(calls)


def _copy_ms(num_bytes: int) -> float:
    # Random bytes, not zeros (METHOD.md: zeros can time differently).
    src = torch.randint(0, 256, (num_bytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return _median_ms(lambda: dst.copy_(src))


def _gbps(num_bytes: int, ms: float) -> float:
    return num_bytes / (ms * 1e-3) / 1e9
