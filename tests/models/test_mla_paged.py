"""MLA's GPU step (models/mla_paged.py) on the CPU, its kernels under Triton's interpreter: the
prefill chunks' grouping into padded batches, and HF's greedy tokens when every batch is cut small
(the test_families cases run it with one batch a step)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

pytest.importorskip("triton", reason="MLA's GPU step needs the triton package")

from test_families import ENGINE_OPTIONS, GREEDY, MLA_CASES

from pagedllm import LLM
from pagedllm.models import mla_paged


@pytest.mark.parametrize(
    ("seq_lens", "first", "budget", "groups"),
    [
        ([5, 100, 30, 40], 1, 10_000, [(1, 4)]),  # every prefill in one batch, decodes left out
        ([100, 30, 40, 10], 0, 2 * 100 * 4, [(0, 2), (2, 4)]),  # 2 x 100 fits, a third would not
        ([10, 500, 20], 0, 1000, [(0, 1), (1, 2), (2, 3)]),  # a context past the budget alone
        ([7, 8], 2, 100, []),  # no prefills
    ],
)
def test_prefill_groups_bound_the_padded_batch(
    monkeypatch: pytest.MonkeyPatch, seq_lens: list[int], first: int, budget: int, groups: list
) -> None:
    monkeypatch.setattr(mla_paged, "_PREFILL_BATCH_ELEMENTS", budget)
    cut = mla_paged._prefill_groups(seq_lens, first, num_heads=4)
    assert [(g.start, g.stop) for g in cut] == groups


@pytest.mark.slow
def test_greedy_equals_hf_with_prefills_in_small_batches(
    monkeypatch: pytest.MonkeyPatch, greedy_reference: Callable
) -> None:
    """Batches of one or two prefill chunks (48-token chunks behind cached prefixes)."""
    config_class, overrides = MLA_CASES["deepseekv2-q-lora-yarn"]
    model, prompts, expected = greedy_reference(config_class, overrides, GREEDY.max_tokens, "cpu", 7)
    monkeypatch.setattr(mla_paged, "_PREFILL_BATCH_ELEMENTS", 4 * 200)  # 4 heads: 200 tokens
    llm = LLM(model, attention_backend="triton", **ENGINE_OPTIONS)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
