"""Pooling on a GPU: float32 embeddings equal HF's pooled hidden states, eager and with CUDA graphs
(a step of one-token prompts only replays a captured graph, whose output buffer the pooler must
copy out before the next replay), chunked prefill and asynchronous scheduling (the GPU default:
the vectors come back through pinned memory one step later)."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM
from tests.pooling.conftest import PROMPTS, hf_pooled, save_tiny_decoder

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

ONE_TOKEN_PROMPTS = [[7], [8], [9]]


@pytest.mark.parametrize("enforce_eager", [True, False])
@pytest.mark.parametrize("mode,pooling", [("mean_tokens", "MEAN"), ("lasttoken", "LAST")])
def test_float32_embeddings_equal_hf_on_the_gpu(
    tmp_path, enforce_eager: bool, mode: str, pooling: str
) -> None:
    # Head size 64: a size the Triton and CUDA kernels support.
    model_dir = save_tiny_decoder(tmp_path, "llama", pooling_mode=mode, head_dim=64)
    llm = LLM(
        model_dir,
        runner="pooling",
        device="cuda",
        dtype="float32",
        skip_tokenizer_init=True,
        enforce_eager=enforce_eager,
        gpu_memory_utilization=0.3,
        enable_chunked_prefill=True,
        max_num_batched_tokens=16,
        max_num_seqs=4,
    )
    for prompts in (PROMPTS, ONE_TOKEN_PROMPTS):
        outputs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
        want = hf_pooled(model_dir, prompts, pooling)
        for output, expected in zip(outputs, want):
            torch.testing.assert_close(torch.tensor(output.outputs.embedding), expected, atol=1e-4, rtol=1e-3)
