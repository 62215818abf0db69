"""Speculative verify steps under CUDA graphs, float32: with batch expansion (worker/step_inputs.py)
a step of decodes and verifications is a decode step of one sequence per token, and replays the
captured decode graph of that many rows. Greedy output is token for token that of decoding without
speculation on the same backend (and HF's), for n-gram drafts on both graph-capturing backends,
with a window on every layer, and for an EAGLE-3 head."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from test_engine_gpu import hf_greedy
from transformers import LlamaConfig, Phi3Config

sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))
from test_spec_decode import mixed_prompts
from test_spec_eagle import write_head

from pagedllm import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
# Drafting at every batch size (on a GPU n-gram stops at 2 running requests by default).
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_max": 3,
    "disable_by_batch_size": None,
}
# Head size 64 for every kernel.
MODELS = {
    "llama": (LlamaConfig, {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}),
    "phi3-window16": (
        Phi3Config,
        {
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 64,
            "sliding_window": 16,
            # Special tokens inside the tiny vocabulary (Phi-3's defaults are its tokenizer's).
            "pad_token_id": 0,
            "bos_token_id": 1,
            "eos_token_id": 2,
        },
    ),
}


def record_steps(llm: LLM) -> list[tuple[int, int | None]]:
    """Wrap the runner's input staging: per step (verified rows, the graph's real rows or None)."""
    runner = llm.llm_engine.executor.worker.model_runner
    steps = []
    prepare = runner.prepare_inputs

    def recording(scheduler_output):
        model_input = prepare(scheduler_output)
        steps.append((model_input.num_verify_rows, model_input.graph_num_seqs))
        return model_input

    runner.prepare_inputs = recording
    return steps


def make_llm(model: str, **engine_args: object) -> LLM:
    return LLM(model, device="cuda", dtype="float32", num_kv_blocks=256, max_num_seqs=4, **engine_args)


def generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def replayed_verify_steps(steps: list[tuple[int, int | None]]) -> list[int]:
    """The graph sizes of the steps that verified drafts under a graph; asserts there were some."""
    verify_steps = [graph_num_seqs for num_verify, graph_num_seqs in steps if num_verify]
    replayed = [n for n in verify_steps if n is not None]
    assert verify_steps and replayed
    return replayed


@pytest.mark.parametrize("backend", ["triton", "cuda"])
@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["host-lookup", "device-lookup"])
def test_ngram_verify_steps_replay_decode_graphs_and_change_no_output(
    make_tiny_model, backend, model, async_scheduling
):
    """Synchronous scheduling looks drafts up on the host; asynchronous (CUDA's default), on the
    device (worker/ngram_drafter.py)."""
    config_class, overrides = MODELS[model]
    hf_model, model_config = make_tiny_model(config_class, **overrides)
    prompts = mixed_prompts(6, model_config.vocab_size, seed=5)
    plain = make_llm(model_config.model, attention_backend=backend)
    expected = generate(plain, prompts)
    del plain
    llm = make_llm(
        model_config.model,
        attention_backend=backend,
        speculative_config=NGRAM,
        async_scheduling=async_scheduling,
    )
    assert llm.llm_engine.config.drafts_on_worker is async_scheduling
    steps = record_steps(llm)
    assert generate(llm, prompts) == expected
    if model == "llama":
        assert expected == hf_greedy(hf_model, prompts, GREEDY.max_tokens)
    # Graphs of more rows than the 4 requests: verifications expanded into decodes.
    assert max(replayed_verify_steps(steps)) > 4
    assert llm.llm_engine.scheduler.spec_decoding.num_accepted_tokens > 0


def test_eagle3_verify_steps_replay_decode_graphs_and_equal_hf(make_tiny_model, tmp_path):
    """Four layers for EAGLE-3's default layers (2, 2, 1); one head of 64 in the head too."""
    hf_model, model_config = make_tiny_model(
        LlamaConfig, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64
    )
    path, _, _ = write_head(
        tmp_path / "head", model_config.hf_config, "eagle3", 96, num_attention_heads=1, num_key_value_heads=1
    )
    prompts = mixed_prompts(6, model_config.vocab_size, seed=6)
    llm = make_llm(
        model_config.model,
        speculative_config={"method": "eagle3", "model": path, "num_speculative_tokens": 3},
    )
    steps = record_steps(llm)
    assert generate(llm, prompts) == hf_greedy(hf_model, prompts, GREEDY.max_tokens)
    replayed_verify_steps(steps)
