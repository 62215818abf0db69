"""Speculative decoding with the multi-token-prediction layer a DeepSeek-V3 checkpoint stores
(``method="mtp"``) end to end on the CPU, float32.

The checkpoint is HF's DeepSeek-V3 (or GLM-4-MoE) with one decoder layer more than its config
counts: that layer, ``model.layers.L``, plus the head's own tensors (``enorm``, ``hnorm``,
``eh_proj``, ``shared_head``) in a second safetensors file, is the MTP layer, laid out as
DeepSeek-V3's and GLM-4.5's checkpoints store it.

* the drafts the engine proposes are those of an independent implementation: HF's own decoder
  layer for the block (MLA or grouped attention, routed experts), torch for the rest;
* greedy output is HF ``generate``'s and that of decoding without speculation;
* a target without an MTP layer, or of a family whose layer is not supported, is refused before
  loading, naming the method.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from test_spec_decode import assert_all_blocks_free, mixed_prompts, token_ids
from test_spec_eagle import GREEDY, _rms, record_proposals
from transformers import AutoModelForCausalLM, DeepseekV3Config, Glm4MoeConfig, LlamaConfig
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeRotaryEmbedding

from pagedllm import LLM, SamplingParams
from tests.models.test_families import CASES, MLA_CASES

# DeepSeek-V3 in small (MLA with q_lora, noaux_tc routing over 8 experts in 4 groups) and GLM-4.5
# (grouped attention with biases and q/k norms, half the head rotated), both with a dense layer
# first: the MTP layer, past it, has experts, as theirs do.
MLA_V3 = {**MLA_CASES["deepseekv3-noaux-tc"][1], "num_nextn_predict_layers": 1}
GLM4_MOE = {**CASES["glm4moe-grouped"][1], "num_nextn_predict_layers": 1}
# family: (config class, overrides, HF's rotary embedding)
FAMILIES = {
    "deepseek_v3": (DeepseekV3Config, MLA_V3, DeepseekV3RotaryEmbedding),
    "glm4_moe": (Glm4MoeConfig, GLM4_MOE, Glm4MoeRotaryEmbedding),
}
NUM_LAYERS = 2  # the target's; the checkpoint's layer 2 is the MTP layer
SPEC = {"method": "mtp", "num_speculative_tokens": 3}


def write_target_with_mtp(make_model, config_class, overrides: dict, num_layers: int = NUM_LAYERS):
    """(HF target, its directory, HF's MTP block, the head's tensors): a model of num_layers + 1
    layers saved (``make_model``: a make_tiny_model fixture), then its config cut to num_layers,
    the head's tensors written beside its last layer's."""
    hf_twin, model_config = make_model(config_class, **{**overrides, "num_hidden_layers": num_layers + 1})
    directory = model_config.model
    with open(f"{directory}/config.json") as f:
        config = json.load(f)
    config["num_hidden_layers"] = num_layers
    with open(f"{directory}/config.json", "w") as f:
        json.dump(config, f)
    hidden, vocab = hf_twin.config.hidden_size, hf_twin.config.vocab_size
    g = torch.Generator().manual_seed(7)
    head = {
        "enorm.weight": 1.0 + 0.1 * torch.randn(hidden, generator=g),
        "hnorm.weight": 1.0 + 0.1 * torch.randn(hidden, generator=g),
        "eh_proj.weight": 0.15 * torch.randn(hidden, 2 * hidden, generator=g),
        "shared_head.norm.weight": 1.0 + 0.1 * torch.randn(hidden, generator=g),
        "shared_head.head.weight": torch.randn(vocab, hidden, generator=g),
    }
    save_file({f"model.layers.{num_layers}.{k}": v for k, v in head.items()}, f"{directory}/mtp.safetensors")
    hf_target = AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, attn_implementation="eager"
    )
    return hf_target.eval(), directory, hf_twin.model.layers[num_layers], head


# GLM-4-MoE's cases run with the slow ones (the suite's time): DeepSeek-V3's cover the fast set.
@pytest.fixture(scope="module", params=["deepseek_v3", pytest.param("glm4_moe", marks=pytest.mark.slow)])
def target_with_mtp(request, make_tiny_model_for_module):
    """(HF target, its directory, HF's MTP block, the head's tensors, HF's rotary class)."""
    config_class, overrides, rotary_class = FAMILIES[request.param]
    return *write_target_with_mtp(make_tiny_model_for_module, config_class, overrides), rotary_class


def reference_drafts(hf_target, block, head, rotary_class, tokens: list[int], k: int) -> list[int]:
    """The MTP layer's k greedy drafts after ``tokens``, from scratch: at position p it reads
    token p + 1 (zeroed at position 0) and the target's final hidden state at p; later steps
    read its own previous output (before the norm)."""
    config = hf_target.config
    rotary = rotary_class(config)
    with torch.no_grad():
        target_hidden = hf_target.model(torch.tensor([tokens])).last_hidden_state[0]
        embed = hf_target.get_input_embeddings().weight
        inputs, hidden = list(tokens[1:]), list(target_hidden[: len(tokens) - 1])
        drafts = []
        for _ in range(k):
            n = len(inputs)
            positions = torch.arange(n)
            emb = embed[torch.tensor(inputs)] * (positions != 0)[:, None]
            x = torch.cat(
                [_rms(emb, head["enorm.weight"]), _rms(torch.stack(hidden), head["hnorm.weight"])], -1
            )
            x = x @ head["eh_proj.weight"].T
            causal = torch.full((n, n), float("-inf")).triu(1)[None, None]
            stream = block(
                x[None],
                attention_mask=causal,
                position_ids=positions[None],
                position_embeddings=rotary(x[None], positions[None]),
            )
            stream = (stream[0] if isinstance(stream, tuple) else stream)[0]
            logits = _rms(stream[-1], head["shared_head.norm.weight"]) @ head["shared_head.head.weight"].T
            drafts.append(int(logits.argmax()))
            inputs.append(drafts[-1])
            hidden.append(stream[-1])
        return drafts


def test_the_engines_drafts_are_the_mtp_layers_and_greedy_output_is_hfs(target_with_mtp, hf_greedy_tokens):
    hf_target, directory, block, head, rotary_class = target_with_mtp
    prompts = [list(range(3, 33)), *mixed_prompts(3, hf_target.config.vocab_size, seed=5)]
    llm = LLM(
        directory,
        device="cpu",
        block_size=4,
        max_num_batched_tokens=16,
        enable_chunked_prefill=True,
        max_num_seqs=4,
        speculative_config=SPEC,
    )
    drafter = llm.llm_engine.executor.worker.model_runner.drafter
    assert type(drafter.model).__name__ == f"{hf_target.config.architectures[0]}MTP"
    assert drafter.compute_logits == drafter.model.compute_logits  # its own shared_head.head
    calls = record_proposals(llm)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    assert token_ids(outputs) == [hf_greedy_tokens(hf_target, prompt, 16) for prompt in prompts]
    contexts = {o.request_id: prompts[i] + o.outputs[0].token_ids for i, o in enumerate(outputs)}
    checked = 0
    for step in calls:
        for req_id, (length, drafts) in step.items():
            assert drafts == reference_drafts(
                hf_target, block, head, rotary_class, contexts[str(req_id)][:length], 3
            )
            checked += 1
    assert checked >= 8, "the test must check proposals"
    assert llm.llm_engine.scheduler.spec_decoding.num_draft_tokens > 0
    assert_all_blocks_free(llm)


def test_mtp_runs_on_the_triton_backend(make_tiny_model, hf_greedy_tokens):
    """The layer's cache "head" (kv_lora_rank + rope dims) is no attention backend's head size:
    the drafter, like the target, leaves MLA's layers to check their own kernels (on a GPU the
    Triton backend once refused the draft's 576). Triton's interpreter, DeepSeek-V3's own dims."""
    v3_dims = {**MLA_V3, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "head_dim": 64, "qk_nope_head_dim": 128,
               "v_head_dim": 128}  # fmt: skip
    hf_target, directory, *_ = write_target_with_mtp(make_tiny_model, DeepseekV3Config, v3_dims, num_layers=1)
    prompt = list(range(3, 12))
    llm = LLM(directory, device="cpu", attention_backend="triton", block_size=16, speculative_config=SPEC)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outputs = llm.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)
    assert token_ids(outputs) == [hf_greedy_tokens(hf_target, prompt, 6)]
    assert llm.llm_engine.scheduler.spec_decoding.num_draft_tokens > 0


@pytest.mark.slow  # the test above compares greedy output with HF's already
def test_mtp_drafts_change_no_output_with_prefix_caching(target_with_mtp):
    _, directory, *_ = target_with_mtp
    prompts = mixed_prompts(5, 160, seed=2)
    plain = LLM(directory, device="cpu", block_size=4)
    expected = token_ids(plain.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False))
    spec = LLM(directory, device="cpu", block_size=4, enable_prefix_caching=True, speculative_config=SPEC)
    assert (
        token_ids(spec.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)) == expected
    )


def test_a_target_without_a_supported_mtp_layer_is_refused_before_loading(make_tiny_model, tmp_path):
    no_layer = tmp_path / "no_layer"  # a config alone: refused before any weight is read
    DeepseekV3Config(
        **{**MLA_V3, "num_nextn_predict_layers": 0}, architectures=["DeepseekV3ForCausalLM"]
    ).save_pretrained(no_layer)
    with pytest.raises(ValueError, match=r"method 'mtp'.*no multi-token-prediction layer"):
        LLM(str(no_layer), device="cpu", load_format="dummy", speculative_config=SPEC)
    _, llama = make_tiny_model(LlamaConfig)
    with pytest.raises(ValueError, match=r"method 'mtp'.*no multi-token-prediction layer"):
        LLM(llama.model, device="cpu", speculative_config=SPEC)
    _, claims_one = make_tiny_model(LlamaConfig, num_nextn_predict_layers=1)
    with pytest.raises(
        ValueError, match=r"method 'mtp'.*LlamaForCausalLM's multi-token-prediction layers are not"
    ):
        LLM(claims_one.model, device="cpu", speculative_config=SPEC)


@pytest.mark.slow
def test_mtp_at_tensor_parallel_size_2_gives_hfs_greedy_output(target_with_mtp, hf_greedy_tokens):
    """Two ranks (the "mp" executor, asynchronous scheduling): each builds the layer from the same
    parallel layers and keeps its heads' KV (MLA: the latent, replicated)."""
    hf_target, directory, *_ = target_with_mtp
    prompts = mixed_prompts(4, hf_target.config.vocab_size, seed=3)
    llm = LLM(
        directory,
        device="cpu",
        block_size=4,
        tensor_parallel_size=2,
        async_scheduling=True,
        speculative_config=SPEC,
    )
    try:
        outputs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
        assert token_ids(outputs) == [hf_greedy_tokens(hf_target, p, 16) for p in prompts]
        assert llm.llm_engine.get_stats().spec_decoding.num_draft_tokens > 0
    finally:
        llm.llm_engine.shutdown()
