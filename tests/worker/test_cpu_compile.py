"""The CPU's compiled one-stream decode step against the eager model, in float32.

Tiny random models (GQA ratios 1 and 2, a sliding window shorter than the sequence) decode the
same tokens eagerly and through ``CompiledDecode`` over copies of one paged cache: the hidden
states agree to float32 rounding (inductor fuses and reorders the small ops) and the greedy tokens
are the same. The compilation runs once per model, a few seconds on two cores.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, MistralConfig

from pagedllm.attention import bind_kv_caches, set_forward_context
from pagedllm.attention.backends.cpu_backend import CpuAttentionBackend
from pagedllm.model_loader import get_model
from pagedllm.worker.cpu_compile import CompiledDecode

CASES = {
    "llama-gqa2": (LlamaConfig, {"num_attention_heads": 4, "num_key_value_heads": 2}),
    "mistral-window8-mha": (
        MistralConfig,
        {"num_attention_heads": 4, "num_key_value_heads": 4, "sliding_window": 8},
    ),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.slow
def test_compiled_decode_matches_eager_in_float32(case: str, make_tiny_model, paged_runner) -> None:
    config_class, overrides = CASES[case]
    _, model_config = make_tiny_model(config_class, **overrides)
    model = get_model(model_config, "auto", torch.device("cpu"), CpuAttentionBackend)
    assert CompiledDecode.supports(model)
    eager, compiled = paged_runner(model, model_config), paged_runner(model, model_config)
    # Other blocks than the eager runner's: a compiled step that read or wrote the eager cache
    # (the caches it was compiled with, not those bound now) would read unwritten NaN slots.
    compiled.free_blocks.reverse()
    prompt = torch.randint(
        0, model_config.hf_config.vocab_size, (13,), generator=torch.Generator().manual_seed(1)
    )
    for runner in (eager, compiled):
        runner.step({0: prompt.tolist()})
    decode = CompiledDecode(model)
    eager_token = compiled_token = int(prompt[-1])
    with torch.inference_mode():
        for step in range(12):  # past the window and across blocks of 4
            eager_logits = eager.step({0: [eager_token]})[0]
            compiled._grow(0, compiled.seq_lens[0] + 1)
            position = torch.tensor([compiled.seq_lens[0] - 1])
            # The compiled step reads the caches bound to the layers: the compiled runner's.
            bind_kv_caches(model, compiled.kv_caches)
            with set_forward_context(compiled.build_metadata({0: [0]})):
                hidden = decode(torch.tensor([compiled_token]), position)
            compiled_logits = model.compute_logits(hidden)
            torch.testing.assert_close(compiled_logits, eager_logits, atol=1e-4, rtol=1e-4)
            eager_token, compiled_token = int(eager_logits.argmax()), int(compiled_logits.argmax())
            assert compiled_token == eager_token, f"step {step}"


def test_engine_compiles_only_where_inductor_lowers_the_layers(make_tiny_model) -> None:
    """Dense layers prepacked for oneDNN (the bf16 and float32 engines) are opaque to inductor:
    those models stay eager."""
    from pagedllm.layers.onednn_linear import prepack_dense_weights

    _, model_config = make_tiny_model(LlamaConfig)
    model = get_model(model_config, "auto", torch.device("cpu"), CpuAttentionBackend)
    assert CompiledDecode.supports(model)
    prepack_dense_weights(model)
    assert not CompiledDecode.supports(model)
