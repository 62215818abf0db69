"""With chunked prefill (the server's default), a 6,000-token prompt arriving beside a running
stream delays that stream's next token by at most one step of the token budget."""

from __future__ import annotations

from transformers import LlamaConfig

from pagedllm import SamplingParams
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine

LONG_PROMPT = 6000
TOKEN_BUDGET = 1024


def test_a_long_prompt_never_stalls_a_running_stream(make_tiny_model):
    _, model_config = make_tiny_model(
        LlamaConfig, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192
    )
    args = EngineArgs(
        model=model_config.model,
        device="cpu",
        max_model_len=8192,
        enable_chunked_prefill=True,
        max_num_batched_tokens=TOKEN_BUDGET,
        num_kv_blocks=1024,
    )
    engine = LLMEngine.from_engine_args(args)
    engine.add_request(
        "victim", prompt_token_ids=[1, 2, 3], sampling_params=SamplingParams(max_tokens=20, ignore_eos=True)
    )
    engine.step()  # the victim's prefill: it is decoding from now on
    engine.add_request(
        "long", prompt_token_ids=[5] * LONG_PROMPT, sampling_params=SamplingParams(max_tokens=1)
    )
    num_victim_tokens = 1
    num_steps = 0
    while "long" in engine.requests:
        outputs = {output.request_id: output for output in engine.step()}
        num_steps += 1
        # Every step, the victim gets its next token while the long prompt is computed in chunks.
        assert len(outputs["victim"].outputs[0].token_ids) == num_victim_tokens + 1
        num_victim_tokens += 1
        assert engine.get_stats().num_prefill_tokens <= 3 + num_steps * TOKEN_BUDGET
    # The prompt needed about LONG_PROMPT / budget steps, each of which also decoded the victim.
    assert num_steps >= LONG_PROMPT // TOKEN_BUDGET
