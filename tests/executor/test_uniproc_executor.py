"""The in-process executor's shutdown: what its worker held goes back, the engine refuses steps."""

from __future__ import annotations

import gc
import weakref

import pytest
from transformers import LlamaConfig

from pagedllm import LLM, SamplingParams
from pagedllm.executor.abstract import ExecutorDeadError


def test_shutdown_lets_the_worker_go_while_the_engine_object_lives(make_tiny_model):
    _, model_config = make_tiny_model(LlamaConfig)
    llm = LLM(model_config.model, device="cpu", dtype="float32", kv_cache_memory=1 << 22)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    assert len(llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=params, use_tqdm=False)) == 1
    executor = llm.llm_engine.engine_core.executor
    worker = weakref.ref(executor.worker)
    llm.llm_engine.shutdown()
    gc.collect()
    # The weights and the KV cache went with the worker, though `llm` is still referenced.
    assert worker() is None
    with pytest.raises(ExecutorDeadError, match="shut down"):
        executor.collective_rpc("get_kv_cache_spec")
    llm.llm_engine.shutdown()  # a second shutdown is a no-op
