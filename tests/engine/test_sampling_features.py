"""Issue 3's options end to end on the CPU: beam search, best_of, penalties, logprobs, prompt
logprobs, prefix caching and chunked prefill, each against Hugging Face or a direct computation."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import LlamaConfig, Qwen2Config
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from pagedllm import LLM, BeamSearchParams, SamplingParams
from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.penalties import apply_penalties
from pagedllm.tokenizer import apply_chat_template


def ragged_prompts(n: int, vocab_size: int, seed: int, lo: int = 2, hi: int = 24) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def assert_all_blocks_free(llm: LLM) -> None:
    engine = llm.llm_engine
    bm = engine.scheduler.kv_cache_manager
    assert not engine.has_unfinished_requests()
    assert bm.get_num_free_gpu_blocks() == bm.num_total_gpu_blocks
    assert bm.get_num_free_cpu_blocks() == bm.num_total_cpu_blocks
    assert bm.get_num_requests_with_blocks() == 0


@pytest.fixture
def tiny(make_tiny_model):
    # vocab 160 with eos 2: random weights reach EOS now and then, so beams do end early.
    return make_tiny_model(LlamaConfig, num_attention_heads=4, num_key_value_heads=2)


def hf_beam_search(hf_model, prompt, num_beams, n, max_tokens, length_penalty, early_stopping, eos):
    input_ids = torch.tensor([prompt])
    out = hf_model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        num_beams=num_beams,
        num_return_sequences=n,
        do_sample=False,
        max_new_tokens=max_tokens,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        eos_token_id=eos,
        pad_token_id=eos,
    )
    sequences = []
    for row in out[:, len(prompt) :].tolist():
        # HF pads finished hypotheses after their EOS.
        sequences.append(row[: row.index(eos) + 1] if eos in row else row)
    return sequences


@pytest.mark.parametrize(
    "num_beams, n, length_penalty, early_stopping",
    [(2, 1, 1.0, False), (4, 2, 1.0, True), (3, 3, 0.5, "never"), (4, 4, 2.0, False), (2, 2, -1.0, True)],
)
def test_beam_search_equals_hf(tiny, num_beams, n, length_penalty, early_stopping):
    hf_model, model_config = tiny
    eos = model_config.hf_config.eos_token_id
    llm = LLM(model_config.model, device="cpu", block_size=4)
    prompts = ragged_prompts(3, model_config.vocab_size, seed=num_beams * 10 + n)
    params = SamplingParams(
        n=n,
        best_of=num_beams,
        use_beam_search=True,
        temperature=0.0,
        max_tokens=14,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
    )
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        expected = hf_beam_search(hf_model, prompt, num_beams, n, 14, length_penalty, early_stopping, eos)
        assert [c.token_ids for c in output.outputs] == expected
        assert [c.index for c in output.outputs] == list(range(n))
    assert_all_blocks_free(llm)


@pytest.mark.slow  # the real model through HF and the engine: 24 s here
def test_beam_search_equals_hf_on_the_embedded_model(smollm2_hf_model):
    llm = LLM(device="cpu", max_model_len=256, dtype="float32")  # compared with HF in float32
    tokenizer = llm.get_tokenizer()
    eos = tokenizer.eos_token_id
    params = SamplingParams(n=2, best_of=3, use_beam_search=True, temperature=0.0, max_tokens=20)
    for question in ("What is the capital of France?", "Name a famous painter."):
        prompt = apply_chat_template(tokenizer, [{"role": "user", "content": question}])
        output = llm.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)[0]
        expected = hf_beam_search(smollm2_hf_model, prompt, 3, 2, 20, 1.0, False, eos)
        assert [c.token_ids for c in output.outputs] == expected
        assert output.outputs[0].text == tokenizer.decode(expected[0], skip_special_tokens=True)


def test_best_of_allocates_the_prompt_once_and_returns_the_best_n(tiny):
    _, model_config = tiny
    llm = LLM(model_config.model, device="cpu", block_size=4)
    engine = llm.llm_engine
    prompt = ragged_prompts(1, model_config.vocab_size, seed=1, lo=22, hi=22)[0]
    params = SamplingParams(n=4, best_of=8, temperature=1.0, seed=3, max_tokens=10, ignore_eos=True)
    engine.add_request("0", sampling_params=params, prompt_token_ids=prompt)
    engine.step()
    group = engine.engine_core.requests["0"].group
    bm = engine.scheduler.kv_cache_manager
    seqs = list(group.members)
    tables = [bm.get_block_ids(seq) for seq in seqs]
    assert len(tables) == 8
    num_prompt_blocks = (len(prompt) + 3) // 4
    assert all(table == tables[0] for table in tables), "every sample shares the prompt's blocks"
    assert bm.num_total_gpu_blocks - bm.get_num_free_gpu_blocks() == num_prompt_blocks
    final = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            final = output
    assert final is not None and final.finished and len(final.outputs) == 4
    everything = sorted((seq.cumulative_logprob for seq in seqs), reverse=True)
    assert [c.cumulative_logprob for c in final.outputs] == everything[:4]
    assert_all_blocks_free(llm)


def test_penalties_match_hf_and_the_openai_formula():
    torch.manual_seed(0)
    vocab = 50
    logits = torch.randn(3, vocab) * 3
    prompt = [1, 2, 3, 3]
    outputs = [[4, 4, 5], [], [1, 6, 6, 6]]
    params = [
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(presence_penalty=0.5, frequency_penalty=0.25),
        SamplingParams(repetition_penalty=0.8, presence_penalty=-1.0, frequency_penalty=1.5),
    ]
    counts = torch.stack(
        [torch.bincount(torch.tensor(o, dtype=torch.long), minlength=vocab) for o in outputs]
    )
    metadata = SamplingMetadata(
        temperature=None,
        greedy=None,
        all_greedy=True,
        presence_penalty=torch.tensor([p.presence_penalty for p in params]),
        frequency_penalty=torch.tensor([p.frequency_penalty for p in params]),
        repetition_penalty=torch.tensor([p.repetition_penalty for p in params]),
        output_counts=counts.float(),
        prompt_mask=(torch.bincount(torch.tensor(prompt), minlength=vocab) > 0).expand(3, vocab),
    )
    got = apply_penalties(logits.clone(), metadata)
    for i, p in enumerate(params):
        expected = logits[i : i + 1].clone()
        if p.repetition_penalty != 1.0:
            history = torch.tensor([prompt + outputs[i]])
            expected = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(history, expected)
        counts = torch.bincount(torch.tensor(outputs[i], dtype=torch.long), minlength=vocab).float()
        expected = expected - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)
        torch.testing.assert_close(got[i : i + 1], expected)


def test_penalties_push_outputs_the_expected_way(tiny):
    _, model_config = tiny
    llm = LLM(model_config.model, device="cpu")
    prompts = ragged_prompts(6, model_config.vocab_size, seed=4)

    def repeats(params: SamplingParams) -> float:
        outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        ids = [o.outputs[0].token_ids for o in outputs]
        return sum(len(t) - len(set(t)) for t in ids) / sum(len(t) for t in ids)

    base = dict(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = repeats(SamplingParams(**base))
    assert repeats(SamplingParams(frequency_penalty=2.0, **base)) < plain
    assert repeats(SamplingParams(presence_penalty=2.0, **base)) < plain
    assert repeats(SamplingParams(repetition_penalty=2.0, **base)) < plain
    assert repeats(SamplingParams(frequency_penalty=-2.0, **base)) > plain


def test_logprobs_and_prompt_logprobs_equal_hf_log_softmax(make_tiny_model):
    hf_model, model_config = make_tiny_model(Qwen2Config, num_attention_heads=4, num_key_value_heads=2)
    # Chunked prefill splits the prompt: prompt logprobs must still cover every position once.
    llm = LLM(
        model_config.model,
        device="cpu",
        enable_chunked_prefill=True,
        max_num_batched_tokens=16,
        max_num_seqs=4,
    )
    prompt = ragged_prompts(1, model_config.vocab_size, seed=5, lo=30, hi=30)[0]
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=5, prompt_logprobs=3, ignore_eos=True)
    output = llm.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)[0]
    completion = output.outputs[0]
    full = prompt + completion.token_ids
    with torch.no_grad():
        reference = torch.log_softmax(hf_model(torch.tensor([full])).logits[0].float(), dim=-1)

    assert output.prompt_logprobs[0] is None and len(output.prompt_logprobs) == len(prompt)
    for position, entry in enumerate(output.prompt_logprobs[1:], start=1):
        token = prompt[position]
        row = reference[position - 1]
        assert abs(entry[token].logprob - row[token].item()) < 1e-4
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        top = row.topk(3)
        for rank, (value, token_id) in enumerate(zip(top.values.tolist(), top.indices.tolist()), start=1):
            assert abs(entry[token_id].logprob - value) < 1e-4
            assert entry[token_id].rank == rank

    assert len(completion.logprobs) == len(completion.token_ids)
    cumulative = 0.0
    for step, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        row = reference[len(prompt) - 1 + step]
        assert abs(entry[token].logprob - row[token].item()) < 1e-4
        assert entry[token].rank == 1  # greedy
        assert set(entry) == set(row.topk(5).indices.tolist())
        cumulative += row[token].item()
    assert abs(completion.cumulative_logprob - cumulative) < 1e-3
    assert_all_blocks_free(llm)


def test_prefix_caching_computes_only_the_suffix_and_changes_nothing(tiny):
    _, model_config = tiny
    rng = random.Random(6)
    prefix = [rng.randrange(3, model_config.vocab_size) for _ in range(200)]
    suffixes = [[rng.randrange(3, model_config.vocab_size) for _ in range(k)] for k in (7, 13, 1)]
    prompts = [prefix + s for s in suffixes]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    plain = LLM(model_config.model, device="cpu", block_size=8, max_model_len=256)
    expected = [
        o.outputs[0].token_ids for o in plain.generate(prompt_token_ids=prompts, sampling_params=params)
    ]

    cached = LLM(
        model_config.model, device="cpu", block_size=8, max_model_len=256, enable_prefix_caching=True
    )
    engine = cached.llm_engine
    first = cached.generate(prompt_token_ids=prompts[:1], sampling_params=params, use_tqdm=False)
    assert engine.get_stats().num_prefill_tokens == len(prompts[0])
    rest = cached.generate(prompt_token_ids=prompts[1:], sampling_params=params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first + rest] == expected
    # The 200-token prefix is 25 full blocks: the later requests compute only what follows it.
    stats = engine.get_stats()
    assert stats.num_prefill_tokens == len(prompts[0]) + len(suffixes[1]) + len(suffixes[2])
    assert stats.prefix_cache_hit_rate > 0.6
    assert_all_blocks_free(cached)


@pytest.mark.slow
def test_prefix_cache_eviction_under_memory_pressure_loses_nothing(tiny):
    _, model_config = tiny
    rng = random.Random(7)
    prefixes = [[rng.randrange(3, model_config.vocab_size) for _ in range(40)] for _ in range(4)]
    prompts = [
        prefixes[i % 4] + [rng.randrange(3, model_config.vocab_size) for _ in range(5)] for i in range(16)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    plain = LLM(model_config.model, device="cpu", block_size=4, max_model_len=96)
    expected = [
        o.outputs[0].token_ids for o in plain.generate(prompt_token_ids=prompts, sampling_params=params)
    ]
    # 40 blocks: cached prefixes are evicted again and again to make room, and requests preempted.
    tight = LLM(
        model_config.model,
        device="cpu",
        block_size=4,
        max_model_len=96,
        num_kv_blocks=40,
        enable_prefix_caching=True,
    )
    got = tight.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == expected
    assert tight.llm_engine.get_stats().prefix_cache_hit_rate > 0
    assert_all_blocks_free(tight)


@pytest.mark.parametrize("budget", [16, 64, None])
def test_chunked_prefill_budgets_give_identical_greedy_outputs(tiny, budget):
    _, model_config = tiny
    prompts = ragged_prompts(6, model_config.vocab_size, seed=8, lo=10, hi=90)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    reference = LLM(model_config.model, device="cpu", max_model_len=128)
    expected = [
        o.outputs[0].token_ids for o in reference.generate(prompt_token_ids=prompts, sampling_params=params)
    ]
    chunked = LLM(
        model_config.model,
        device="cpu",
        max_model_len=128,
        enable_chunked_prefill=True,
        max_num_seqs=8,
        max_num_batched_tokens=budget or 128,
    )
    got = chunked.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == expected
    assert_all_blocks_free(chunked)


def test_a_long_prompt_never_stalls_running_decodes(make_tiny_model):
    _, model_config = make_tiny_model(
        LlamaConfig, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096
    )
    llm = LLM(
        model_config.model,
        device="cpu",
        max_model_len=2100,
        enable_chunked_prefill=True,
        max_num_batched_tokens=64,
        max_num_seqs=16,
    )
    engine = llm.llm_engine
    decoding = ragged_prompts(8, model_config.vocab_size, seed=9)
    for i, prompt in enumerate(decoding):
        engine.add_request(
            f"d{i}", sampling_params=SamplingParams(max_tokens=60, ignore_eos=True), prompt_token_ids=prompt
        )
    engine.step()  # the 8 prompts
    long_prompt = ragged_prompts(1, model_config.vocab_size, seed=10, lo=2000, hi=2000)[0]
    engine.add_request(
        "long", sampling_params=SamplingParams(max_tokens=4, ignore_eos=True), prompt_token_ids=long_prompt
    )
    steps_while_prefilling = 0
    while not engine.requests["long"].seqs:  # no token yet
        got_tokens = {o.request_id for o in engine.step()}
        live = {rid for rid in engine.requests if rid.startswith("d")}
        assert live <= got_tokens, "a running decode was skipped"
        steps_while_prefilling += 1
    assert steps_while_prefilling >= 2000 // 64
    while engine.has_unfinished_requests():
        engine.step()
    assert_all_blocks_free(llm)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"n": 3, "best_of": 2, "temperature": 1.0}, "best_of"),
        ({"n": 1, "best_of": 2, "temperature": 0.0}, "best_of"),
        ({"use_beam_search": True, "best_of": 2, "temperature": 0.0, "top_p": 0.5}, "top_p"),
        ({"use_beam_search": True, "best_of": 2, "temperature": 0.0, "top_k": 4}, "top_k"),
        ({"use_beam_search": True, "best_of": 2, "temperature": 0.0, "stop": ["x"]}, "stop"),
        ({"logprobs": 21}, "logprobs"),
        ({"prompt_logprobs": 50}, "prompt_logprobs"),
        ({"presence_penalty": -2.5}, "presence_penalty"),
        ({"frequency_penalty": 3.0}, "frequency_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ],
)
def test_bad_combinations_are_refused(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field} must be"):
        SamplingParams(**kwargs)


def test_llm_beam_search_returns_the_hf_beams_in_vllms_shape(tiny):
    hf_model, model_config = tiny
    eos = model_config.hf_config.eos_token_id
    llm = LLM(model_config.model, device="cpu", block_size=4)
    prompts = ragged_prompts(2, model_config.vocab_size, seed=7)
    params = BeamSearchParams(beam_width=3, max_tokens=10, length_penalty=0.5)
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, output in zip(prompts, outputs):
        expected = hf_beam_search(hf_model, prompt, 3, 3, 10, 0.5, False, eos)
        assert [s.tokens for s in output.sequences] == [prompt + beam for beam in expected]
    # One beam is greedy decoding: HF's argmax continuation, with its cumulative logprob.
    [greedy] = llm.beam_search(
        [{"prompt_token_ids": prompts[0]}], BeamSearchParams(beam_width=1, max_tokens=6)
    )
    input_ids = torch.tensor([prompts[0]])
    hf = hf_model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        do_sample=False,
        max_new_tokens=6,
        eos_token_id=eos,
        pad_token_id=eos,
        output_scores=True,
        return_dict_in_generate=True,
    )
    generated = hf.sequences[0, len(prompts[0]) :].tolist()
    generated = generated[: generated.index(eos) + 1] if eos in generated else generated
    [sequence] = greedy.sequences
    assert sequence.tokens == prompts[0] + generated
    hf_logprobs = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(hf.scores, generated)]
    assert sequence.cum_logprob == pytest.approx(sum(hf_logprobs), abs=1e-3)
    assert_all_blocks_free(llm)


@pytest.mark.parametrize(
    "fields, name", [({"temperature": 0.7}, "temperature"), ({"beam_width": 0}, "beam_width")]
)
def test_beam_search_params_refuse_what_they_cannot_honour(fields, name):
    with pytest.raises(ValueError, match=f"^{name} must be"):
        BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, **fields})
