"""The batch-invariant attention (attention/backends/triton_invariant_backend.py): one
``paged_prefill`` launch config for every query, so a query's output row is the same bits whether
it is decoded (a query of one) beside any other sequences, prefilled whole, or prefilled in chunks
split anywhere; and it matches a torch softmax reference within rounding (on the CPU under
TRITON_INTERPRET=1 at tiny shapes; on CUDA as well when there is one)."""

from __future__ import annotations

import pytest
import torch

from pagedllm.attention.backends.triton_invariant_backend import invariant_launch
from pagedllm.kernels.triton import paged_prefill

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 4, 2, 64, 16
SEQ_LEN = 100  # past one 64-key tile and into a partial one
SCALE = HEAD_SIZE**-0.5
NEEDS_GPU = pytest.mark.skipif(DEVICE == "cpu", reason="Triton's interpreter has no bfloat16")
DTYPES = [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=NEEDS_GPU)]


class Sequences:
    """Random sequences whose whole K/V already sits in a paged cache, each in blocks of its own."""

    def __init__(
        self,
        seq_lens: list[int],
        dtype: torch.dtype,
        heads: tuple[int, int, int] = (NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE),
    ) -> None:
        generator = torch.Generator().manual_seed(len(seq_lens))
        num_heads, num_kv_heads, self.head_size = heads
        blocks_per_seq = -(-max(seq_lens) // BLOCK_SIZE)
        num_blocks = blocks_per_seq * len(seq_lens)
        shape = (num_blocks, num_kv_heads, BLOCK_SIZE, self.head_size)
        self.key_cache = torch.randn(shape, generator=generator).to(DEVICE, dtype)
        self.value_cache = torch.randn(shape, generator=generator).to(DEVICE, dtype)
        order = torch.randperm(num_blocks, generator=generator)  # blocks scattered over the cache
        self.block_tables = order.view(len(seq_lens), blocks_per_seq).to(DEVICE, torch.int32)
        self.queries = [
            torch.randn(n, num_heads, self.head_size, generator=generator).to(DEVICE, dtype) for n in seq_lens
        ]
        self.seq_lens = seq_lens

    def attend(self, chunks: list[tuple[int, int]]) -> list[torch.Tensor]:
        """One launch over the (sequence, query positions [start, seq_len)) pairs: the output rows of
        each, the way the backend runs a step (query_len 1: a decode; a launch with a longer query
        takes the prefill chunks' configuration, decodes included)."""
        query = torch.cat([self.queries[s][start:] for s, start in chunks])
        query_lens = [self.seq_lens[s] - start for s, start in chunks]
        query_start_loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
        out = torch.empty_like(query)
        rows = torch.tensor([s for s, _ in chunks])
        paged_prefill(
            query,
            self.key_cache,
            self.value_cache,
            self.block_tables[rows.to(DEVICE)],
            torch.tensor([self.seq_lens[s] for s, _ in chunks], dtype=torch.int32, device=DEVICE),
            query_start_loc.to(DEVICE),
            SCALE,
            0,
            len(chunks),
            max(query_lens),
            out,
            **invariant_launch(self.head_size, self.key_cache.dtype, prefill=max(query_lens) > 1),
        )
        return list(out.split(query_lens))

    def reference(self, s: int) -> torch.Tensor:
        """Causal softmax attention of sequence s in float64, from its K/V read out of the blocks."""
        n = self.seq_lens[s]
        blocks = self.block_tables[s, : -(-n // BLOCK_SIZE)].long()
        keys = self.key_cache[blocks].permute(0, 2, 1, 3).reshape(-1, NUM_KV_HEADS, HEAD_SIZE)[:n].double()
        values = (
            self.value_cache[blocks].permute(0, 2, 1, 3).reshape(-1, NUM_KV_HEADS, HEAD_SIZE)[:n].double()
        )
        group = NUM_HEADS // NUM_KV_HEADS
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", self.queries[s].double(), keys) * SCALE
        scores.masked_fill_(torch.ones(n, n, dtype=torch.bool, device=DEVICE).triu(1), float("-inf"))
        return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)


# (heads, KV heads, head size): the tests' small shape; on the GPU also Qwen3-0.6B's, Llama-3.1-8B's
# group of 4 and a head of 256, where the prefill chunks' 32-row tiles must sum as the decodes' 16.
HEAD_SHAPES = [
    (NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE),
    pytest.param((16, 8, 128), marks=NEEDS_GPU),
    pytest.param((32, 8, 128), marks=NEEDS_GPU),
    pytest.param((8, 4, 256), marks=NEEDS_GPU),
]


@pytest.mark.parametrize("heads", HEAD_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_query_row_is_the_same_bits_decoded_prefilled_or_chunked(
    dtype: torch.dtype, heads: tuple[int, int, int]
) -> None:
    seqs = Sequences([SEQ_LEN, 37, 70, 5], dtype, heads)
    whole = seqs.attend([(0, 0)])[0]  # sequence 0 prefilled in one chunk, alone
    for start in (1, 17, 63, 64, 90):  # a cached prefix (or earlier chunks) of `start` tokens
        assert torch.equal(seqs.attend([(0, start)])[0], whole[start:])
    last = SEQ_LEN - 1
    # Decoded alone, beside other decodes, beside prefills, in another place of the batch.
    for chunks in ([(0, last)], [(1, 36), (0, last), (2, 69)], [(3, 0), (2, 10), (0, last)]):
        outs = seqs.attend(chunks)
        (position,) = [i for i, (s, _) in enumerate(chunks) if s == 0]
        assert torch.equal(outs[position], whole[last:])
    # A chunk in a step with other sequences' rows is as when alone.
    assert torch.equal(seqs.attend([(2, 0), (0, 40), (1, 0)])[1], whole[40:])


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-4), (torch.float16, 4e-3)])
def test_matches_torch_attention(dtype: torch.dtype, tolerance: float) -> None:
    seqs = Sequences([SEQ_LEN, 37], dtype)
    for s, out in enumerate(seqs.attend([(0, 0), (1, 20)])):
        expected = seqs.reference(s)[-out.shape[0] :]
        torch.testing.assert_close(out.double(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.slow
def test_engine_on_the_invariant_backend_keeps_rows_and_scores_equal(make_tiny_model) -> None:
    """The whole engine with batch_invariant=True on the Triton backend (its attention under the
    interpreter on the CPU): greedy tokens and logprobs alone equal those in a batch, through
    chunked prefill and a prefix-cache hit, and equal a scoring pass over prompt + output."""
    from transformers import LlamaConfig

    from pagedllm import LLM, SamplingParams

    _, model_config = make_tiny_model(
        LlamaConfig, num_attention_heads=4, num_key_value_heads=2, head_dim=64, hidden_size=64
    )
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 160, (n,), generator=generator).tolist() for n in (9, 30, 17)]
    prompts.append([*prompts[1][:24], 5, 6])  # behind a cached prefix of sequence 1
    llm = LLM(
        model_config.model,
        device=DEVICE,
        dtype="float32",
        attention_backend="triton",
        batch_invariant=True,
        block_size=8,
        enable_prefix_caching=True,
        enable_chunked_prefill=True,
        max_num_batched_tokens=16,
        max_num_seqs=4,
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=5, logprobs=0, ignore_eos=True)

    def generate(batch: list[list[int]]) -> list[tuple[list[int], list[float]]]:
        outputs = llm.generate(prompt_token_ids=batch, sampling_params=greedy, use_tqdm=False)
        return [
            (c.token_ids, [e[t].logprob for t, e in zip(c.token_ids, c.logprobs)])
            for c in (o.outputs[0] for o in outputs)
        ]

    alone = [generate([p])[0] for p in prompts]
    assert generate(prompts) == alone
    score = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    full = [p + tokens for p, (tokens, _) in zip(prompts, alone)]
    for p, (tokens, logprobs), out in zip(
        prompts, alone, llm.generate(prompt_token_ids=full, sampling_params=score, use_tqdm=False)
    ):
        assert [e[t].logprob for t, e in zip(tokens, out.prompt_logprobs[len(p) :])] == logprobs


@pytest.mark.parametrize(
    "variant",
    [
        {},
        {"sliding_window": 24},
        {"alibi_slopes": torch.tensor([0.5, 0.25, 0.125, 0.0625])},
        {"logits_soft_cap": 5.0},
        {"sinks": torch.tensor([0.5, -1.0, 2.0, 0.0])},
    ],
    ids=["plain", "window", "alibi", "soft-cap", "learned-sinks"],
)
def test_packing_a_kv_group_into_the_rows_changes_no_bit(variant: dict) -> None:
    """pack_gqa puts a KV group's heads in one program's rows; each row's arithmetic is unchanged,
    so the unpacked launch (one head per program) gives the same bits, attention variants included."""
    seqs = Sequences([SEQ_LEN, 37, 5], torch.float32)
    variant = {key: value.to(DEVICE) if torch.is_tensor(value) else value for key, value in variant.items()}
    query = torch.cat([seqs.queries[0][30:], seqs.queries[1][36:], seqs.queries[2]])
    query_start_loc = torch.tensor([0, SEQ_LEN - 30, SEQ_LEN - 29, SEQ_LEN - 24], dtype=torch.int32)
    outs = []
    for pack_gqa in (True, False):
        launch = {**invariant_launch(HEAD_SIZE, torch.float32), "pack_gqa": pack_gqa}
        out = torch.empty_like(query)
        seq_lens = torch.tensor(seqs.seq_lens, dtype=torch.int32, device=DEVICE)
        paged_prefill(
            query,
            seqs.key_cache,
            seqs.value_cache,
            seqs.block_tables,
            seq_lens,
            query_start_loc.to(DEVICE),
            SCALE,
            0,
            3,
            SEQ_LEN - 30,
            out,
            **variant,
            **launch,
        )
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
