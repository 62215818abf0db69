"""Speculative decoding with EAGLE heads (``method="eagle3"`` and ``"eagle"``) end to end on the
CPU, float32. Heads are written in the public checkpoints' layout (safetensors, names as
SafeAILab's EAGLE-3 / EAGLE heads store them, a draft vocabulary mapped by ``d2t``):

* the drafts the engine proposes are those of an independent torch implementation of the head
  (HF's hidden states of the target, plain-torch attention without a cache), step after step;
* greedy output is HF ``generate``'s and that of decoding without speculation, on Llama and Qwen3
  targets, in ragged batches, through preemption, prefix caching and chunked prefill;
* sampled output follows the target's exact distribution;
* bad configurations are refused before any weight is read, naming the field.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from test_spec_decode import (
    SAMPLED_CASES,
    TIGHT,
    assert_all_blocks_free,
    exact_joint,
    make_llm,
    mixed_prompts,
    pair_p_value,
    token_ids,
)
from transformers import LlamaConfig, Qwen3Config
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from pagedllm import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
HEAD_HEADS = {"num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 80}


# --- heads in the public layout -------------------------------------------------------------------


def head_config(target_config, method: str, draft_vocab_size: int | None, **extra) -> LlamaConfig:
    config = LlamaConfig(
        vocab_size=target_config.vocab_size,
        hidden_size=target_config.hidden_size,
        num_hidden_layers=1,
        max_position_embeddings=128,  # less than the target's: the engine extends it
        rms_norm_eps=1e-6,
        **{**HEAD_HEADS, **extra},
    )
    config.architectures = ["LlamaForCausalLMEagle3" if method == "eagle3" else "LlamaForCausalLM"]
    if draft_vocab_size is not None:
        config.draft_vocab_size = draft_vocab_size
    return config


def write_head(directory, target_config, method: str, draft_vocab_size: int | None = None, seed=0, **extra):
    """A random EAGLE-3 head (fc [H, 3H], midlayer with q/k/v over 2H, hidden_norm, norm, lm_head
    over the draft vocabulary, d2t/t2d) or EAGLE head (fc [H, 2H], layers.0 without its input
    norm), saved as the public checkpoints are. Returns (directory, tensors by name, config)."""
    config = head_config(target_config, method, draft_vocab_size, **extra)
    h, v = config.hidden_size, config.vocab_size
    hd = h // config.num_attention_heads
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=0.3):
        return scale * torch.randn(shape, generator=g)

    def norm():
        return 1.0 + rand(h, scale=0.1)

    prefix = "midlayer." if method == "eagle3" else "layers.0."
    attn_in = 2 * h if method == "eagle3" else h
    i = config.intermediate_size
    tensors = {
        f"{prefix}self_attn.q_proj.weight": rand(config.num_attention_heads * hd, attn_in),
        f"{prefix}self_attn.k_proj.weight": rand(config.num_key_value_heads * hd, attn_in),
        f"{prefix}self_attn.v_proj.weight": rand(config.num_key_value_heads * hd, attn_in),
        f"{prefix}self_attn.o_proj.weight": rand(h, config.num_attention_heads * hd),
        f"{prefix}mlp.gate_proj.weight": rand(i, h),
        f"{prefix}mlp.up_proj.weight": rand(i, h),
        f"{prefix}mlp.down_proj.weight": rand(h, i),
        f"{prefix}post_attention_layernorm.weight": norm(),
    }
    if method == "eagle3":
        dv = draft_vocab_size or v
        tensors |= {
            "fc.weight": rand(h, 3 * h, scale=0.15),
            "midlayer.input_layernorm.weight": norm(),
            "midlayer.hidden_norm.weight": norm(),
            "norm.weight": norm(),
            "lm_head.weight": rand(dv, h, scale=1.0),
        }
        if draft_vocab_size is not None:
            # The draft vocabulary: dv target ids, ascending; d2t[d] = target id - d.
            targets = torch.randperm(v, generator=g)[:dv].sort().values
            tensors["d2t"] = targets - torch.arange(dv)
            t2d = torch.zeros(v, dtype=torch.bool)
            t2d[targets] = True
            tensors["t2d"] = t2d
    else:
        tensors["fc.weight"] = rand(h, 2 * h, scale=0.2)
    directory.mkdir(parents=True, exist_ok=True)
    save_file({name: t.contiguous() for name, t in tensors.items()}, str(directory / "model.safetensors"))
    config.save_pretrained(directory)
    return str(directory), tensors, config


# --- an independent reference of the heads -----------------------------------------------------------


def _rms(x, weight, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _attention(x, w, prefix, config, positions):
    """Causal GQA attention over the whole sequence, rotary as HF's Llama. x: [T, in]."""
    nh, nkv = config.num_attention_heads, config.num_key_value_heads
    hd = config.hidden_size // nh
    t = x.shape[0]
    q = (x @ w[f"{prefix}self_attn.q_proj.weight"].T).view(t, nh, hd).transpose(0, 1)[None]
    k = (x @ w[f"{prefix}self_attn.k_proj.weight"].T).view(t, nkv, hd).transpose(0, 1)[None]
    v = (x @ w[f"{prefix}self_attn.v_proj.weight"].T).view(t, nkv, hd).transpose(0, 1)[None]
    cos, sin = LlamaRotaryEmbedding(config)(v, positions[None])
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    k, v = k.repeat_interleave(nh // nkv, dim=1), v.repeat_interleave(nh // nkv, dim=1)
    scores = (q @ k.transpose(-1, -2)) * hd**-0.5
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    out = (scores.softmax(-1) @ v)[0].transpose(0, 1).reshape(t, nh * hd)
    return out @ w[f"{prefix}self_attn.o_proj.weight"].T


def _mlp(x, w, prefix):
    gate = x @ w[f"{prefix}mlp.gate_proj.weight"].T
    up = x @ w[f"{prefix}mlp.up_proj.weight"].T
    return (torch.nn.functional.silu(gate) * up) @ w[f"{prefix}mlp.down_proj.weight"].T


def reference_drafts(hf_target, method, w, config, tokens, k, aux_layers=None) -> list[int]:
    """The head's k greedy drafts after ``tokens`` (the request's whole context), from scratch:
    the head at position p reads token p + 1 and the target's hidden state at p (EAGLE-3: the
    inputs of ``aux_layers``, HF's hidden_states[i]; EAGLE: the last, normed); later steps read
    the head's own previous output."""
    with torch.no_grad():
        out = hf_target(torch.tensor([tokens]), output_hidden_states=True)
        states = out.hidden_states
        embed = hf_target.get_input_embeddings().weight
        if method == "eagle3":
            target_hidden = torch.cat([states[i][0] for i in aux_layers], dim=-1) @ w["fc.weight"].T
        else:
            target_hidden = states[-1][0]
        inputs = list(tokens[1:])  # token p + 1 at position p
        hidden = list(target_hidden[: len(tokens) - 1])
        drafts = []
        for _ in range(k):
            emb = embed[torch.tensor(inputs)]
            hid = torch.stack(hidden)
            positions = torch.arange(len(inputs))
            if method == "eagle3":
                normed = _rms(hid, w["midlayer.hidden_norm.weight"])
                x = torch.cat([_rms(emb, w["midlayer.input_layernorm.weight"]), normed], dim=-1)
                residual = hid + _attention(x, w, "midlayer.", config, positions)
                stream = residual + _mlp(
                    _rms(residual, w["midlayer.post_attention_layernorm.weight"]), w, "midlayer."
                )
                logits = _rms(stream[-1], w["norm.weight"]) @ w["lm_head.weight"].T
                draft = int(logits.argmax())
                draft += int(w["d2t"][draft]) if "d2t" in w else 0
            else:
                x = torch.cat([emb, hid], dim=-1) @ w["fc.weight"].T
                residual = x + _attention(x, w, "layers.0.", config, positions)
                stream = residual + _mlp(
                    _rms(residual, w["layers.0.post_attention_layernorm.weight"]), w, "layers.0."
                )
                draft = int(hf_target.lm_head(stream[-1]).argmax())
            drafts.append(draft)
            inputs.append(draft)
            hidden.append(stream[-1])
        return drafts


def record_proposals(llm):
    """Wrap the worker's drafter: a list of (context length, req_id -> drafts) per step."""
    drafter = llm.llm_engine.executor.worker.model_runner.drafter
    calls = []
    propose = drafter.propose

    def recording(rows, newest):
        req_ids = drafter.batch.req_ids
        # The context a proposal continues: up to its newest token, whose position may include a
        # verification's accepted drafts not yet counted on the host.
        positions = newest.on_device(drafter.device).tolist()
        lengths = {req_ids[r]: p + 1 for r, p in zip(rows.tolist(), positions)}
        proposed, drafts = propose(rows, newest)
        calls.append(
            {req_ids[r]: (lengths[req_ids[r]], ids) for r, ids in zip(proposed.tolist(), drafts.tolist())}
        )
        return proposed, drafts

    drafter.propose = recording
    return calls


def assert_drafts_are_the_references(calls, prompts, outputs, hf_model, spec, tensors, config, aux) -> int:
    """Every recorded proposal (``record_proposals``) equals the reference head's 3 drafts on the
    context it was made from; returns how many were checked."""
    contexts = {o.request_id: prompts[i] + o.outputs[0].token_ids for i, o in enumerate(outputs)}
    checked = 0
    for step in calls:
        for req_id, (length, drafts) in step.items():
            context = contexts[str(req_id)][:length]
            assert drafts == reference_drafts(hf_model, spec["method"], tensors, config, context, 3, aux)
            checked += 1
    return checked


# --- fixtures ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama(make_tiny_model_for_module):
    return make_tiny_model_for_module(
        LlamaConfig, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2
    )


@pytest.fixture(scope="module")
def qwen3(make_tiny_model_for_module):
    return make_tiny_model_for_module(
        Qwen3Config, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32
    )


# (method, draft_vocab_size, aux layers or None for vLLM's default (2, L // 2, L - 3) = (2, 2, 1))
HEADS = {
    "eagle3-draft-vocab": ("eagle3", 96, None),
    "eagle3-full-vocab": ("eagle3", None, [0, 2, 3]),
    "eagle": ("eagle", None, None),
}


def make_head(tmp_path_factory, model_config, name, seed=0):
    method, draft_vocab, aux = HEADS[name]
    extra = {} if aux is None else {"eagle_aux_hidden_state_layer_ids": aux}
    directory = tmp_path_factory.mktemp(name)
    path, tensors, config = write_head(directory, model_config.hf_config, method, draft_vocab, seed, **extra)
    spec = {"method": method, "model": path, "num_speculative_tokens": 3}
    return spec, tensors, config, aux or [2, 2, 1]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(HEADS))
def test_the_engines_drafts_are_an_independent_reference_heads(llama, tmp_path_factory, name):
    hf_model, model_config = llama
    spec, tensors, config, aux = make_head(tmp_path_factory, model_config, name)
    # 16-token steps cut the prompts into chunks: a chunk's last position reads the next prompt token.
    # The first prompt's first chunk is a step alone, in which nothing samples: the head's K/V of
    # its tokens is written all the same (later proposals read it).
    prompts = [list(range(3, 33))]
    prompts += mixed_prompts(3, model_config.vocab_size, seed=5)
    llm = make_llm(
        model_config,
        block_size=4,
        enable_chunked_prefill=True,
        max_num_batched_tokens=16,
        max_num_seqs=4,
        speculative_config=spec,
    )
    calls = record_proposals(llm)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    checked = assert_drafts_are_the_references(calls, prompts, outputs, hf_model, spec, tensors, config, aux)
    assert checked >= 6
    if HEADS[name][1] is not None:  # the draft vocabulary maps to target ids outside its range
        assert any(d >= HEADS[name][1] for step in calls for _, ds in step.values() for d in ds)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["eagle3-draft-vocab", "eagle"])
def test_the_heads_steps_on_the_graphs_static_buffers_draft_as_the_reference(
    llama, tmp_path_factory, hf_greedy_tokens, name
):
    """The k - 1 head steps run on the buffers a CUDA graph replays (padded to sizes 1, 2, 4; the
    CPU has no graphs, so the loop runs on them eagerly) through the torch backend, which reads
    each row's length on the device as the GPU kernels do: the drafts are the reference's."""
    hf_model, model_config = llama
    spec, tensors, config, aux = make_head(tmp_path_factory, model_config, name, seed=3)
    prompts = mixed_prompts(3, model_config.vocab_size, seed=6)
    llm = make_llm(
        model_config, block_size=4, max_num_seqs=4, attention_backend="torch", speculative_config=spec
    )
    drafter = llm.llm_engine.executor.worker.model_runner.drafter
    drafter.graphs = drafter.proposal_graphs([1, 2, 4])
    calls = record_proposals(llm)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert token_ids(outputs) == [hf_greedy_tokens(hf_model, prompt, 8) for prompt in prompts]
    checked = assert_drafts_are_the_references(calls, prompts, outputs, hf_model, spec, tensors, config, aux)
    assert checked >= 6 and any(len(step) == 3 for step in calls)  # three requests padded to 4


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("name", list(HEADS))
def test_greedy_with_an_eagle_head_equals_hf_and_decoding_without_it(
    request, tmp_path_factory, hf_greedy_tokens, family, name
):
    hf_model, model_config = request.getfixturevalue(family)
    spec, *_ = make_head(tmp_path_factory, model_config, name, seed=1)
    prompts = mixed_prompts(6, model_config.vocab_size)
    llm = make_llm(model_config, block_size=4, speculative_config=spec)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    assert token_ids(outputs) == [hf_greedy_tokens(hf_model, prompt, 16) for prompt in prompts]
    counters = llm.llm_engine.scheduler.spec_decoding
    assert counters.num_draft_tokens > 0, "the test must verify drafts"
    assert_all_blocks_free(llm)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["eagle3-draft-vocab", "eagle"])
def test_an_eagle_head_changes_no_output_under_preemption_prefix_caching_and_chunks(
    llama, tmp_path_factory, name
):
    _, model_config = llama
    spec, *_ = make_head(tmp_path_factory, model_config, name, seed=2)
    shared = mixed_prompts(1, model_config.vocab_size, seed=3)[0][:12]
    prompts = [shared + p for p in mixed_prompts(8, model_config.vocab_size, seed=1)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = make_llm(model_config, block_size=4)
    expected = token_ids(plain.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False))
    tight = make_llm(
        model_config,
        **TIGHT,
        speculative_config=spec,
    )
    for _ in range(2):  # the second run finds the first one's blocks in the prefix cache
        outputs = tight.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        assert token_ids(outputs) == expected
    stats = tight.llm_engine.get_stats()
    assert stats.num_preemptions_recompute > 0
    assert stats.prefix_cache_hit_rate > 0
    assert tight.llm_engine.scheduler.spec_decoding.num_draft_tokens > 0
    assert_all_blocks_free(tight)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(SAMPLED_CASES))
def test_sampled_outputs_follow_the_target_distribution_with_an_eagle3_head(
    make_tiny_model_for_module, tmp_path_factory, case
):
    hf_model, model_config = make_tiny_model_for_module(
        LlamaConfig, vocab_size=8, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2
    )
    path, *_ = write_head(tmp_path_factory.mktemp("head8"), model_config.hf_config, "eagle3", 6)
    params = SAMPLED_CASES[case]
    prompt = [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 5, 6]
    joint = exact_joint(hf_model, prompt, params, 4)
    spec = {"method": "eagle3", "model": path, "num_speculative_tokens": 3}
    llm = make_llm(model_config, block_size=4, max_num_seqs=256, speculative_config=spec)
    outputs = llm.generate(prompt_token_ids=[prompt] * 3000, sampling_params=params, use_tqdm=False)
    samples = [tuple(o.outputs[0].token_ids) for o in outputs]
    for first in range(3):
        assert pair_p_value(samples, joint, first) > 1e-3, first
    counters = llm.llm_engine.scheduler.spec_decoding
    assert 0 < counters.num_accepted_tokens < counters.num_draft_tokens


# --- configuration ---------------------------------------------------------------------------------


def test_an_eagle_head_the_engine_cannot_run_is_refused_before_loading(llama, tmp_path, monkeypatch):
    _, model_config = llama
    target_config = model_config.hf_config

    def head(name, **changes):
        config = head_config(target_config, "eagle3", None)
        for key, value in changes.items():
            setattr(config, key, value)
        config.save_pretrained(tmp_path / name)
        return {"method": "eagle3", "model": str(tmp_path / name), "num_speculative_tokens": 3}

    def no_loading(*args, **kwargs):
        raise AssertionError("weights were read before the config was refused")

    monkeypatch.setattr("pagedllm.model_loader.get_model", no_loading)
    cases = [
        (
            head("wide", hidden_size=2 * target_config.hidden_size),
            {},
            r"speculative_config.model .* hidden_size 128",
        ),
        (
            head("vocab", vocab_size=target_config.vocab_size + 1),
            {},
            r"speculative_config.model .* vocabulary",
        ),
        (head("layers", eagle_aux_hidden_state_layer_ids=[0, 1, 9]), {}, "eagle_aux_hidden_state_layer_ids"),
        (head("tp", intermediate_size=81), {"tensor_parallel_size": 2}, "tensor_parallel_size"),
        (
            {"method": "eagle3", "model": str(tmp_path / "layers"), "num_speculative_tokens": 17},
            {},
            "num_speculative_tokens",
        ),
        ({"method": "eagle3"}, {}, "speculative_config.model"),
        (
            {"method": "eagle", "model": "/nonexistent/head"},
            {},
            r"speculative_config\.model: model '/nonexistent/head'",
        ),
    ]
    for spec, kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            make_llm(model_config, speculative_config=spec, **kwargs)


@pytest.mark.slow
def test_dummy_weights_cover_the_head_and_change_no_output(llama, tmp_path):
    """``load_format="dummy"`` (``pagedllm bench latency``) initialises the head too, from a
    directory holding only its config.json, and its embeddings are the target's."""
    _, model_config = llama
    head_config(model_config.hf_config, "eagle3", 96).save_pretrained(tmp_path / "head")
    spec = {"method": "eagle3", "model": str(tmp_path / "head"), "num_speculative_tokens": 3}
    prompts = mixed_prompts(4, model_config.vocab_size, seed=6)
    plain = make_llm(model_config, block_size=4, load_format="dummy")
    llm = make_llm(model_config, block_size=4, load_format="dummy", speculative_config=spec)
    expected = token_ids(plain.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False))
    assert (
        token_ids(llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)) == expected
    )
    head = llm.llm_engine.executor.worker.model_runner.drafter.model
    assert head.embed_tokens is None
    assert llm.llm_engine.scheduler.spec_decoding.num_draft_tokens > 0


@pytest.mark.slow
def test_a_head_that_knows_the_target_is_always_accepted(make_tiny_model, tmp_path):
    """A target whose blocks add nothing (o_proj and down_proj zero, unit final norm) predicts
    g(t) = argmax lm_head(embed(t)) after token t. An EAGLE head with fc = [I 0] (the token's
    embedding) and blocks that add nothing outputs embed(t) for the token t it reads at P - 1,
    so its drafts are g(t_P), g(g(t_P)), ...: the target's own tokens. Acceptance is exactly 1.0
    only if every step feeds the head the right token at the right position, also through
    chunked prefill, prefix caching and preemption."""
    hf_model, model_config = make_tiny_model(LlamaConfig, num_attention_heads=4, num_key_value_heads=2)
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                param.zero_()
            elif name == "model.norm.weight":
                param.fill_(1.0)
    hf_model.save_pretrained(model_config.model)
    path, tensors, _ = write_head(tmp_path / "head", model_config.hf_config, "eagle")
    h = model_config.hf_config.hidden_size
    tensors["fc.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)
    for name in ("layers.0.self_attn.o_proj.weight", "layers.0.mlp.down_proj.weight"):
        tensors[name] = torch.zeros_like(tensors[name])
    save_file(tensors, f"{path}/model.safetensors")
    spec = {"method": "eagle", "model": path, "num_speculative_tokens": 4}
    prompts = mixed_prompts(8, model_config.vocab_size, seed=8)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = make_llm(model_config, block_size=4)
    expected = token_ids(plain.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False))
    tight = make_llm(
        model_config,
        **TIGHT,
        speculative_config=spec,
    )
    for _ in range(2):
        outputs = tight.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        assert token_ids(outputs) == expected
    assert tight.llm_engine.get_stats().num_preemptions_recompute > 0
    counters = tight.llm_engine.scheduler.spec_decoding
    assert counters.num_accepted_tokens == counters.num_draft_tokens > 0
    assert_all_blocks_free(tight)
