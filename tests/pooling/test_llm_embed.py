"""LLM.embed / LLM.score with runner="pooling" equal HF's pooled hidden states (float32 CPU),
batched prompts of different lengths, with and without chunked prefill."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModel, LlamaConfig

from pagedllm import LLM
from pagedllm.pooling_params import PoolingParams
from tests.pooling.conftest import PROMPTS, TINY, hf_pooled

ENGINE = dict(runner="pooling", device="cpu", dtype="float32", num_kv_blocks=64, block_size=16)


def _embed(
    model_dir: str, prompts: list[list[int]], params: PoolingParams | None = None, **engine
) -> list[torch.Tensor]:
    llm = LLM(model_dir, skip_tokenizer_init=True, **{**ENGINE, **engine})
    outputs = llm.embed([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [torch.tensor(o.outputs.embedding) for o in outputs]


def _assert_close(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_last_token_embeddings_equal_hf_batched(tiny_decoder, family: str) -> None:
    model_dir = tiny_decoder(family)  # no modules.json: last token, normalized (vLLM's default)
    _assert_close(_embed(model_dir, PROMPTS), hf_pooled(model_dir, PROMPTS, "LAST"))


@pytest.mark.parametrize(
    "mode,pooling", [("lasttoken", "LAST"), ("mean_tokens", "MEAN"), ("cls_token", "CLS")]
)
def test_sentence_transformers_pooling_with_chunked_prefill_equals_hf(
    tiny_decoder, mode: str, pooling: str
) -> None:
    """Prompts of up to 60 tokens over steps of 16: each pooled over its chunks as they come."""
    model_dir = tiny_decoder("llama", pooling_mode=mode)
    got = _embed(model_dir, PROMPTS, enable_chunked_prefill=True, max_num_batched_tokens=16, max_num_seqs=4)
    _assert_close(got, hf_pooled(model_dir, PROMPTS, pooling))


def test_without_normalize_module_embeddings_are_raw_and_request_can_normalize(tiny_decoder) -> None:
    model_dir = tiny_decoder("llama", pooling_mode="mean_tokens", normalize=False)
    _assert_close(_embed(model_dir, PROMPTS[:2]), hf_pooled(model_dir, PROMPTS[:2], "MEAN", normalize=False))
    got = _embed(model_dir, PROMPTS[:2], PoolingParams(normalize=True))
    _assert_close(got, hf_pooled(model_dir, PROMPTS[:2], "MEAN"))


def test_matryoshka_dimensions_truncate_then_normalize(tiny_decoder) -> None:
    model_dir = tiny_decoder("llama", matryoshka_dimensions=[16, 32])
    got = _embed(model_dir, PROMPTS[:3], PoolingParams(dimensions=16))
    raw = hf_pooled(model_dir, PROMPTS[:3], "LAST", normalize=False)
    _assert_close(got, [torch.nn.functional.normalize(v[:16], dim=0) for v in raw])
    with pytest.raises(ValueError, match="matryoshka_dimensions"):
        _embed(model_dir, PROMPTS[:1], PoolingParams(dimensions=8))


def test_score_is_the_cosine_of_hf_embeddings(tiny_embedder_with_tokenizer, smollm2_tokenizer) -> None:
    model_dir = tiny_embedder_with_tokenizer
    llm = LLM(model_dir, **ENGINE)
    query, documents = "what is paged attention", ["paging for the KV cache", "a recipe for bread", "x"]
    scores = llm.score(query, documents, use_tqdm=False)
    token_ids = [smollm2_tokenizer(text)["input_ids"] for text in [query, *documents]]
    want = hf_pooled(model_dir, token_ids, "LAST")
    assert [o.outputs.score for o in scores] == pytest.approx(
        [torch.dot(want[0], w).item() for w in want[1:]], abs=1e-5
    )
    assert scores[0].prompt_token_ids == token_ids[0] + token_ids[1]
    pairwise = llm.score(documents, documents[::-1], use_tqdm=False)  # N -> N
    assert pairwise[1].outputs.score == pytest.approx(1.0, abs=1e-5)
    with pytest.raises(ValueError, match="data_1 has 2 inputs and data_2 3"):
        llm.score(documents[:2], documents, use_tqdm=False)


def test_bad_uses_are_refused_naming_what(tiny_decoder) -> None:
    model_dir = tiny_decoder("llama")
    llm = LLM(model_dir, skip_tokenizer_init=True, **ENGINE)
    with pytest.raises(ValueError, match="dimensions=8: this model does not support Matryoshka"):
        llm.embed({"prompt_token_ids": [1, 2]}, PoolingParams(dimensions=8), use_tqdm=False)
    with pytest.raises(ValueError, match=r"runner='pooling'.*does not generate"):
        llm.generate({"prompt_token_ids": [1, 2]}, use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.embed({"prompt_token_ids": [1] * 300}, use_tqdm=False)
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        LLM(model_dir, skip_tokenizer_init=True, enable_prefix_caching=True, **ENGINE)
    with pytest.raises(ValueError, match="task"):
        LLM(model_dir, task="classify", device="cpu")
    generator = LLM(model_dir, skip_tokenizer_init=True, device="cpu", dtype="float32", num_kv_blocks=64)
    with pytest.raises(ValueError, match="need a pooling model"):
        generator.embed({"prompt_token_ids": [1, 2]}, use_tqdm=False)


def test_task_embed_is_the_pooling_runner(tiny_decoder) -> None:
    model_dir = tiny_decoder("llama")
    llm = LLM(
        model_dir, skip_tokenizer_init=True, task="embed", device="cpu", dtype="float32", num_kv_blocks=64
    )
    got = llm.embed({"prompt_token_ids": PROMPTS[0]}, use_tqdm=False)
    _assert_close([torch.tensor(got[0].outputs.embedding)], hf_pooled(model_dir, PROMPTS[:1]))


def test_async_scheduling_embeddings_equal_hf(tiny_decoder) -> None:
    """With the next step scheduled before this one's vectors come back (the GPU default)."""
    model_dir = tiny_decoder("llama", pooling_mode="mean_tokens")
    got = _embed(
        model_dir,
        PROMPTS,
        async_scheduling=True,
        enable_chunked_prefill=True,
        max_num_batched_tokens=16,
        max_num_seqs=4,
    )
    _assert_close(got, hf_pooled(model_dir, PROMPTS, "MEAN"))


def test_bare_decoder_checkpoint_runs_as_pooling_model_by_default(tmp_path) -> None:
    """A checkpoint saved from transformers' LlamaModel (no LM head, no "model." prefix, as
    embedding models ship theirs): runner "auto" pools it."""
    config = LlamaConfig(**TINY)
    torch.manual_seed(0)
    AutoModel.from_config(config, dtype=torch.float32).save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), skip_tokenizer_init=True, device="cpu", dtype="float32", num_kv_blocks=64)
    assert llm.llm_engine.config.pooler_config is not None
    got = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
    _assert_close([torch.tensor(o.outputs.embedding) for o in got], hf_pooled(str(tmp_path), PROMPTS))
