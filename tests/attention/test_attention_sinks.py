"""Attention sinks (StreamingLLM, Xiao et al. 2023) in the torch and cpu backends.

The torch backend (the oracle of every other backend) is checked against a brute-force reference
written here: each sequence's K/V kept contiguous, and for every query the visible keys listed one
by one from the definition -- key k is visible to query position q iff ``k <= q and (k > q - W or
k < S)``, scored with ``sink_query`` when ``k <= q - W`` -- then a softmax over exactly that list.
The cpu backend is checked against the torch backend and the reference. Batches mix decodes and
prefill chunks behind cached contexts shorter than ``S + W`` and far longer; physical blocks are
shuffled and every cache slot no sequence owns holds NaN.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from pagedllm.attention import bind_kv_caches, set_forward_context
from pagedllm.attention.backends.abstract import AttentionBackend
from pagedllm.attention.backends.cpu_backend import CpuAttentionBackend
from pagedllm.attention.backends.torch_backend import TorchAttentionBackend
from pagedllm.attention.layer import Attention
from pagedllm.attention.metadata import AttentionMetadata

TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2)}


@dataclass
class SinkStep:
    """One step: contiguous per-sequence K/V (for the reference) and the same context in a
    torch-layout paged cache (for the backends)."""

    query: torch.Tensor  # [num_tokens, num_heads, head_size]
    sink_query: torch.Tensor  # the same shape: the query rotated at the sinks' position
    key: torch.Tensor  # [num_tokens, num_kv_heads, head_size], this step's new tokens
    value: torch.Tensor
    caches: tuple[torch.Tensor, torch.Tensor]  # [num_blocks, block_size, num_kv_heads, head_size]
    md: AttentionMetadata
    keys: list[torch.Tensor]  # per sequence, [seq_len, num_kv_heads, head_size]: its whole context
    values: list[torch.Tensor]
    block_size: int

    @property
    def num_real_tokens(self) -> int:
        return int(self.md.query_start_loc_cpu[-1])

    def fresh_caches(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.caches[0].clone(), self.caches[1].clone()

    def run(self, backend: AttentionBackend, with_sink_query: bool = True) -> torch.Tensor:
        """The backend's forward over copies of the caches."""
        sink_query = self.sink_query if with_sink_query else None
        caches = self.fresh_caches()
        return backend.forward(self.query, self.key, self.value, caches, self.md, sink_query=sink_query)

    def poison_unseen(self, window: int, sinks: int) -> None:
        """NaN into every cached slot no query of the step sees (between the sinks and the first
        query's window), as if the engine had freed those blocks."""
        for i, seq_len in enumerate(self.md.seq_lens_cpu.tolist()):
            query_len = int(self.md.query_start_loc_cpu[i + 1] - self.md.query_start_loc_cpu[i])
            first_query_pos = seq_len - query_len
            for pos in range(sinks, first_query_pos - window + 1):
                block = int(self.md.block_tables[i, pos // self.block_size])
                for cache in self.caches:
                    cache[block, pos % self.block_size] = float("nan")


def make_sink_step(
    context_lens: list[int],
    query_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    num_padding_tokens: int = 0,
    seed: int = 0,
) -> SinkStep:
    """Sequence i has context_lens[i] cached tokens and query_lens[i] new ones; decodes first."""
    gen = torch.Generator().manual_seed(seed)
    num_decodes = next((i for i, q in enumerate(query_lens) if q != 1), len(query_lens))
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 2
    perm = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.zeros(len(seq_lens), max(blocks_per_seq) + 1, dtype=torch.int32)
    for i, blocks in enumerate(perm[: sum(blocks_per_seq)].split(blocks_per_seq)):
        block_tables[i, : len(blocks)] = blocks

    def slots(i: int, start: int, end: int) -> torch.Tensor:
        pos = torch.arange(start, end)
        return block_tables[i, pos // block_size].long() * block_size + pos % block_size

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    caches = tuple(
        torch.full((num_blocks, block_size, num_kv_heads, head_size), float("nan"), dtype=dtype)
        for _ in range(2)
    )
    keys = [rand(n, num_kv_heads, head_size) for n in seq_lens]
    values = [rand(n, num_kv_heads, head_size) for n in seq_lens]
    new_keys, new_values = [], []
    for i, ctx in enumerate(context_lens):
        for cache, src in zip(caches, (keys[i], values[i])):
            cache.view(-1, num_kv_heads, head_size)[slots(i, 0, ctx)] = src[:ctx]
        new_keys.append(keys[i][ctx:])
        new_values.append(values[i][ctx:])
    padding = torch.zeros(num_padding_tokens, num_kv_heads, head_size, dtype=dtype)
    slot_mapping = torch.cat(
        [slots(i, c, c + q) for i, (c, q) in enumerate(zip(context_lens, query_lens))]
        + [torch.full((num_padding_tokens,), -1, dtype=torch.int64)]
    )
    num_tokens = slot_mapping.shape[0]
    query_start_loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    md = AttentionMetadata(
        num_decodes=num_decodes,
        num_prefills=len(seq_lens) - num_decodes,
        slot_mapping=slot_mapping,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens_t,
        block_tables=block_tables,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens_t,
    )
    return SinkStep(
        query=rand(num_tokens, num_heads, head_size),
        sink_query=rand(num_tokens, num_heads, head_size),
        key=torch.cat([*new_keys, padding]),
        value=torch.cat([*new_values, padding]),
        caches=caches,
        md=md,
        keys=keys,
        values=values,
        block_size=block_size,
    )


def dense_reference(
    step: SinkStep,
    scale: float,
    window: int,
    sinks: int,
    soft_cap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    learned_sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """[num_real_tokens, num_heads, head_size] float32, one query at a time from the definition.
    learned_sinks ([num_heads], gpt-oss): one more logit per head in the softmax, attending to
    nothing (its probability is dropped)."""
    num_heads = step.query.shape[1]
    num_kv_heads = step.keys[0].shape[1]
    group = num_heads // num_kv_heads
    out = torch.zeros(step.num_real_tokens, num_heads, step.query.shape[2])
    starts = step.md.query_start_loc_cpu.tolist()
    for i, seq_len in enumerate(step.md.seq_lens_cpu.tolist()):
        # Query heads h = kv_head * group + g share KV head h // group.
        keys = step.keys[i].float().repeat_interleave(group, dim=1)  # [seq_len, num_heads, head_size]
        values = step.values[i].float().repeat_interleave(group, dim=1)
        for token in range(starts[i], starts[i + 1]):
            q = seq_len - (starts[i + 1] - starts[i]) + (token - starts[i])  # the query's position
            visible = [k for k in range(seq_len) if k <= q and (k > q - window or k < sinks)]
            scores = []
            for k in visible:
                query = step.sink_query if k <= q - window else step.query
                score = (query[token].float() * keys[k]).sum(-1) * scale  # [num_heads]
                if soft_cap is not None:
                    score = soft_cap * torch.tanh(score / soft_cap)
                if alibi_slopes is not None:
                    score = score + alibi_slopes * (k - q)
                scores.append(score)
            scores = torch.stack(scores)  # [len(visible), num_heads]
            if learned_sinks is not None:
                scores = torch.cat((scores, learned_sinks[None]))
            probs = torch.softmax(scores, dim=0)[: len(visible)]
            out[token] = (probs[:, :, None] * values[visible]).sum(0)
    return out


def _case_id(case: tuple) -> str:
    window, sinks, block_size, (num_heads, num_kv_heads), soft_cap, alibi = case
    return (
        f"W{window}-S{sinks}-b{block_size}-h{num_heads}kv{num_kv_heads}"
        f"{'-softcap' if soft_cap else ''}{'-alibi' if alibi else ''}"
    )


# Every window with every sink count once; block sizes, GQA/MHA, soft cap and ALiBi spread over them.
CASES = [
    (window, sinks, (8, 16)[i % 2], ((8, 2), (4, 4))[(i // 2) % 2], (None, 4.0)[(i // 3) % 2], i % 4 == 3)
    for i, (window, sinks) in enumerate((w, s) for w in (16, 33, 64) for s in (1, 4, 5, 16))
]
# Decodes (contexts from empty, through shorter than S + W, to ~300), then prefill chunks: a fresh
# prompt longer than the window, and chunks behind long cached contexts.
CONTEXT_LENS = [0, 3, 20, 37, 70, 81, 150, 299, 0, 100, 250, 17]
QUERY_LENS = [1] * 8 + [90, 35, 20, 1]


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_torch_backend_matches_dense_reference(case: tuple) -> None:
    window, sinks, block_size, (num_heads, num_kv_heads), soft_cap, alibi = case
    head_size = 16
    step = make_sink_step(
        CONTEXT_LENS, QUERY_LENS, num_heads, num_kv_heads, head_size, block_size, num_padding_tokens=2
    )
    slopes = torch.linspace(0.02, 0.3, num_heads) if alibi else None
    scale = head_size**-0.5
    backend = TorchAttentionBackend(
        num_heads,
        head_size,
        scale,
        num_kv_heads,
        sliding_window=window,
        attention_sinks=sinks,
        logits_soft_cap=soft_cap,
        alibi_slopes=slopes,
    )
    out = step.run(backend)
    ref = dense_reference(step, scale, window, sinks, soft_cap, slopes)
    n = step.num_real_tokens
    assert not out[:n].isnan().any()
    torch.testing.assert_close(out[:n], ref, atol=1e-5, rtol=1e-5)


def test_the_reference_sees_the_sink_query() -> None:
    """The comparison above can fail: a different sink query changes exactly the rows whose window
    has passed a sink, and zero sinks are the plain sliding window."""
    step = make_sink_step([0, 10, 200], [1, 1, 30], 4, 2, 16, 16)
    scale, window = 0.25, 16
    ref = dense_reference(step, scale, window, 4)
    window_only = dense_reference(step, scale, window, 0)
    backend = TorchAttentionBackend(4, 16, scale, 2, sliding_window=window)
    plain = backend.forward(step.query, step.key, step.value, step.fresh_caches(), step.md)
    torch.testing.assert_close(window_only, plain, atol=1e-5, rtol=1e-5)
    # Sequences 0 and 1 are shorter than the window: sinks change nothing there.
    torch.testing.assert_close(ref[:2], window_only[:2], atol=1e-6, rtol=1e-6)
    assert (ref[2:] - window_only[2:]).abs().amax() > 1e-2
    step.sink_query[2:] += 1.0
    assert (dense_reference(step, scale, window, 4)[2:] - ref[2:]).abs().amax() > 1e-2


@pytest.mark.parametrize("case", CASES[::3], ids=_case_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_backend_matches_torch_and_reference(case: tuple, dtype: torch.dtype) -> None:
    window, sinks, block_size, (num_heads, num_kv_heads), soft_cap, alibi = case
    head_size = 16
    step = make_sink_step(
        CONTEXT_LENS, QUERY_LENS, num_heads, num_kv_heads, head_size, block_size, dtype, num_padding_tokens=2
    )
    variants = {
        "sliding_window": window,
        "attention_sinks": sinks,
        "logits_soft_cap": soft_cap,
        "alibi_slopes": torch.linspace(0.02, 0.3, num_heads) if alibi else None,
    }
    scale = head_size**-0.5
    args = (step.query, step.key, step.value)
    cpu = CpuAttentionBackend(num_heads, head_size, scale, num_kv_heads, **variants)
    out = cpu.forward(*args, step.fresh_caches(), step.md, sink_query=step.sink_query)
    ref_backend = TorchAttentionBackend(num_heads, head_size, scale, num_kv_heads, **variants)
    ref = ref_backend.forward(*args, step.fresh_caches(), step.md, sink_query=step.sink_query)
    n = step.num_real_tokens
    assert out.dtype == dtype and not out[:n].isnan().any()
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out[:n].float(), ref[:n].float(), atol=atol, rtol=rtol)
    if dtype == torch.float32:
        dense = dense_reference(step, scale, window, sinks, soft_cap, variants["alibi_slopes"])
        torch.testing.assert_close(out[:n], dense, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_decodes", [3, 12])  # SDPA-sized and matmul-sized decode batches
def test_cpu_backend_decodes_only(num_decodes: int) -> None:
    context_lens = [7 + 23 * i for i in range(num_decodes)]
    step = make_sink_step(context_lens, [1] * num_decodes, 6, 3, 16, 8)
    cpu = CpuAttentionBackend(6, 16, 0.25, 3, sliding_window=33, attention_sinks=5)
    out = step.run(cpu)
    torch.testing.assert_close(out, dense_reference(step, 0.25, 33, 5), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend_cls", [TorchAttentionBackend, CpuAttentionBackend])
def test_freed_blocks_between_sinks_and_window_are_never_used(backend_cls: type) -> None:
    """NaN in every slot between the sinks and the window (freed blocks): the same finite output."""
    window, sinks = 16, 4
    step = make_sink_step(CONTEXT_LENS, QUERY_LENS, 8, 2, 16, 8, num_padding_tokens=2)
    backend = backend_cls(8, 16, 0.25, 2, sliding_window=window, attention_sinks=sinks, logits_soft_cap=5.0)
    args = (step.query, step.key, step.value)
    clean = backend.forward(*args, step.fresh_caches(), step.md, sink_query=step.sink_query)
    nan_before = int(step.caches[0].isnan().sum())
    step.poison_unseen(window, sinks)
    poisoned = step.fresh_caches()
    assert int(poisoned[0].isnan().sum()) > nan_before + 500, "the test poisoned too little"
    out = backend.forward(*args, poisoned, step.md, sink_query=step.sink_query)
    n = step.num_real_tokens
    assert out[:n].isfinite().all()
    torch.testing.assert_close(out[:n], clean[:n], atol=0, rtol=0)


@pytest.mark.parametrize("backend_cls", [TorchAttentionBackend, CpuAttentionBackend])
def test_zero_sinks_ignore_a_sink_query(backend_cls: type) -> None:
    step = make_sink_step([30, 5, 60], [1, 1, 12], 4, 2, 16, 8)
    backend = backend_cls(4, 16, 0.25, 2, sliding_window=16)
    args = (step.query, step.key, step.value)
    plain = backend.forward(*args, step.fresh_caches(), step.md)
    with_sink_query = backend.forward(*args, step.fresh_caches(), step.md, sink_query=step.sink_query)
    torch.testing.assert_close(with_sink_query, plain, atol=0, rtol=0)


@pytest.mark.parametrize("backend_cls", [TorchAttentionBackend, CpuAttentionBackend])
@pytest.mark.parametrize(
    "variants, match",
    [
        ({"attention_sinks": -1, "sliding_window": 16}, "attention_sinks"),
        ({"attention_sinks": 4}, r"attention_sinks.*sliding_window"),
        ({"attention_sinks": 2.5, "sliding_window": 16}, "attention_sinks"),
    ],
)
def test_bad_sinks_are_refused(backend_cls: type, variants: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        backend_cls(4, 16, 0.25, 2, **variants)


@pytest.mark.parametrize("backend_cls", [TorchAttentionBackend, CpuAttentionBackend])
def test_sinks_need_a_sink_query_of_the_query_shape(backend_cls: type) -> None:
    step = make_sink_step([30], [1], 4, 2, 16, 8)
    backend = backend_cls(4, 16, 0.25, 2, sliding_window=16, attention_sinks=4)
    assert backend.attention_sinks == 4
    with pytest.raises(ValueError, match="sink_query"):
        backend.forward(step.query, step.key, step.value, step.fresh_caches(), step.md)
    with pytest.raises(ValueError, match="sink_query"):
        backend.forward(
            step.query, step.key, step.value, step.fresh_caches(), step.md, sink_query=step.sink_query[:, :2]
        )


def test_default_is_no_sinks() -> None:
    assert TorchAttentionBackend(4, 16, 0.25, 2).attention_sinks == 0
    assert issubclass(CpuAttentionBackend, AttentionBackend)


def test_attention_layer_passes_sinks_and_views_the_sink_query() -> None:
    num_heads, num_kv_heads, head_size = 4, 2, 16
    step = make_sink_step([0, 40, 100], [1, 1, 25], num_heads, num_kv_heads, head_size, 8)
    layer = Attention(
        num_heads,
        head_size,
        0.25,
        num_kv_heads,
        TorchAttentionBackend,
        sliding_window=16,
        attention_sinks=5,
    )
    assert layer.impl.attention_sinks == 5 and layer.impl.sliding_window == 16
    num_tokens = step.query.shape[0]
    bind_kv_caches(layer, [step.fresh_caches()])
    with set_forward_context(step.md):
        out = layer(
            step.query.flatten(1),
            step.key.flatten(1),
            step.value.flatten(1),
            sink_query=step.sink_query.flatten(1),
        )
    assert out.shape == (num_tokens, num_heads * head_size)
    ref = dense_reference(step, 0.25, 16, 5)
    torch.testing.assert_close(out.view(num_tokens, num_heads, head_size), ref, atol=1e-5, rtol=1e-5)
    bind_kv_caches(layer, [step.fresh_caches()])
    with set_forward_context(step.md), pytest.raises(ValueError, match="sink_query"):
        layer(step.query.flatten(1), step.key.flatten(1), step.value.flatten(1))


def test_scale_is_applied_once() -> None:
    """A sanity check of the reference itself on one hand-computable case: one query, two keys."""
    step = make_sink_step([1], [1], 1, 1, 4, 8)
    scale = 0.5
    out = dense_reference(step, scale, window=1, sinks=1)
    k0, k1 = step.keys[0][0, 0], step.keys[0][1, 0]
    s0 = float(step.sink_query[0, 0] @ k0) * scale  # key 0 is a sink the 1-token window has passed
    s1 = float(step.query[0, 0] @ k1) * scale
    w0, w1 = math.exp(s0), math.exp(s1)
    expected = (w0 * step.values[0][0, 0] + w1 * step.values[0][1, 0]) / (w0 + w1)
    torch.testing.assert_close(out[0, 0], expected, atol=1e-6, rtol=1e-6)


# Learned sinks (gpt-oss): a logit per head in every softmax, with or without a window.
LEARNED_CASES = [(None, 16, (8, 2)), (24, 8, (4, 4)), (16, 16, (8, 2))]


@pytest.mark.parametrize("window, block_size, heads", LEARNED_CASES)
def test_learned_sinks_torch_and_cpu_match_dense_reference(
    window: int | None, block_size: int, heads: tuple[int, int]
) -> None:
    num_heads, num_kv_heads = heads
    step = make_sink_step(
        CONTEXT_LENS, QUERY_LENS, num_heads, num_kv_heads, 16, block_size, num_padding_tokens=2
    )
    # Logits around the scores' scale: the sink takes a real share of some rows, not all.
    learned = torch.linspace(-2.0, 3.0, num_heads)
    n, scale = step.num_real_tokens, 0.25
    dense = dense_reference(step, scale, window or 10**6, 0, learned_sinks=learned)
    for backend_cls in (TorchAttentionBackend, CpuAttentionBackend):
        backend = backend_cls(num_heads, 16, scale, num_kv_heads, sliding_window=window, sinks=learned)
        out = step.run(backend, with_sink_query=False)
        assert not out[:n].isnan().any()
        torch.testing.assert_close(out[:n], dense, atol=1e-5, rtol=1e-5)
    # The comparison can fail: without the sinks the output differs.
    plain = dense_reference(step, scale, window or 10**6, 0)
    assert (plain - dense).abs().amax() > 1e-2


def test_learned_sinks_of_the_wrong_shape_are_refused() -> None:
    with pytest.raises(ValueError, match=r"sinks must have shape \[4\]"):
        TorchAttentionBackend(4, 16, 0.25, 2, sinks=torch.zeros(2))
