"""Structured outputs and logits processors end to end through ``LLM`` on the embedded model."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.tokenizer import apply_chat_template

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "country": {"enum": ["France", "Spain", "Italy"]},
        "capital": {"type": "boolean"},
    },
    "required": ["city", "country", "capital"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm(smollm2_gguf) -> LLM:
    return LLM(device="cpu", max_model_len=512)


def _chat(llm: LLM, text: str, params: SamplingParams) -> list[str]:
    [output] = llm.chat([{"role": "user", "content": text}], params, use_tqdm=False)
    return [completion.text for completion in output.outputs]


def test_json_schema_output_parses_and_conforms_with_n_and_sampling(llm):
    structured = StructuredOutputsParams(json=SCHEMA)
    params = SamplingParams(n=2, temperature=1.0, seed=0, max_tokens=40, structured_outputs=structured)
    for text in _chat(llm, "Describe Paris as JSON.", params):
        jsonschema.validate(json.loads(text), SCHEMA)


def _count_masks_made_ahead(grammars) -> tuple[list[int], list[bool]]:
    """Per step, how many rows' masks came from the ahead thread: every grammar row in the
    steady state (``_all_made_ahead``), else the rows ``_grammar`` took from it; and per step
    with masks made ahead, whether it was the steady state (then whether its job was resubmitted)."""
    counts: list[int] = []
    steady_steps: list[bool] = []
    grammar, all_made_ahead = grammars._grammar, grammars._all_made_ahead
    before_sampling, start_ahead = grammars.before_sampling, grammars._start_ahead

    def counted_grammar(*args):
        result = grammar(*args)
        counts[-1] += result[1] >= 0
        return result

    def counted_all_made_ahead(ahead, *args):
        steady = all_made_ahead(ahead, *args)
        counts[-1] += len(ahead.sample_rows) if steady else 0
        steady_steps.append(steady)
        return steady

    def counted_before_sampling(*args):
        counts.append(0)
        return before_sampling(*args)

    def counted_start_ahead(*args):
        # A steady step submits the last job's grammars again (``AheadWorker.resubmit``).
        steady_steps.append(grammars._steady is not None)
        return start_ahead(*args)

    grammars._grammar = counted_grammar
    grammars._all_made_ahead = counted_all_made_ahead
    grammars.before_sampling = counted_before_sampling
    grammars._start_ahead = counted_start_ahead
    return counts, steady_steps


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_masks_made_ahead_on_a_thread_give_the_same_outputs(smollm2_gguf, async_scheduling):
    """The grammar masks made ahead on a thread (CUDA's default) and those filled in the step
    give the same tokens for a batch that mixes schemas, choices, n > 1, bad words and plain
    requests, and requests that end at different steps (the batch's rows move)."""
    prompts = ["Describe Paris as JSON.", "Describe Rome as JSON.", "Say hi.", "Pick one."]
    structured = StructuredOutputsParams(json=SCHEMA)
    choice = StructuredOutputsParams(choice=["a", "b"])
    params = [
        SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=40, structured_outputs=structured),
        SamplingParams(temperature=0.0, max_tokens=30, structured_outputs=structured),
        SamplingParams(temperature=0.8, seed=5, max_tokens=12, bad_words=["hi"]),
        SamplingParams(temperature=0.0, max_tokens=6, structured_outputs=choice),
    ]
    conversations = [[{"role": "user", "content": text}] for text in prompts]
    results = {}
    for fill_ahead in (False, True):
        llm = LLM(device="cpu", max_model_len=512, async_scheduling=async_scheduling)
        grammars = llm.llm_engine.executor.worker.model_runner.logits_processors.grammars
        grammars.fill_ahead = fill_ahead
        made_ahead, steady = _count_masks_made_ahead(grammars)
        outputs = llm.chat(conversations, params, use_tqdm=False)
        results[fill_ahead] = [[c.token_ids for c in output.outputs] for output in outputs]
        for output in outputs[:2]:
            for completion in output.outputs:
                jsonschema.validate(json.loads(completion.text), SCHEMA)
        assert outputs[3].outputs[0].text in ("a", "b")
        # Ahead: every decoding step's open grammars (3 JSON rows, then fewer as they end).
        assert (max(made_ahead) == 3 and sum(made_ahead) > 40) == fill_ahead, made_ahead
        # Most such steps need no per-row work; rows ending or moving take the general path.
        assert (sum(steady) > 10 and not all(steady)) == fill_ahead, steady
    assert results[True] == results[False]


def test_choice_regex_and_greedy_in_one_batch(llm):
    tokenizer = llm.get_tokenizer()
    choice = StructuredOutputsParams(choice=["positive", "negative"])
    regex = StructuredOutputsParams(regex=r"[0-9]{3}-[0-9]{4}")
    prompts = [
        {"prompt_token_ids": apply_chat_template(tokenizer, [{"role": "user", "content": p}])}
        for p in ("Is 'I love it' positive or negative?", "Give a phone number.", "Say hi.")
    ]
    params = [
        SamplingParams(temperature=0.0, max_tokens=10, structured_outputs=choice),
        SamplingParams(temperature=0.0, max_tokens=20, structured_outputs=regex),
        SamplingParams(temperature=0.0, max_tokens=5),
    ]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert outputs[0].outputs[0].text in ("positive", "negative")
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", outputs[1].outputs[0].text)
    assert outputs[2].outputs[0].text


def test_allowed_token_ids_bad_words_and_logit_bias(llm):
    tokenizer = llm.get_tokenizer()
    allowed = tokenizer(" yes no maybe", add_special_tokens=False)["input_ids"]
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=8, allowed_token_ids=allowed, ignore_eos=True)
    [output] = llm.generate("Answer:", params, use_tqdm=False)
    assert set(output.outputs[0].token_ids) <= set(allowed)

    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    [plain] = _chat(llm, "What is the capital of France?", greedy)
    assert "Paris" in plain
    banned = SamplingParams(temperature=0.0, max_tokens=12, bad_words=["Paris"])
    [text] = _chat(llm, "What is the capital of France?", banned)
    assert "Paris" not in text

    forced = tokenizer(" banana", add_special_tokens=False)["input_ids"][0]
    biased = SamplingParams(temperature=0.0, max_tokens=3, logit_bias={forced: 100.0})
    [output] = llm.generate("Fruit:", biased, use_tqdm=False)
    assert output.outputs[0].token_ids == [forced] * 3


def test_a_grammar_that_does_not_compile_is_refused_before_it_runs(llm):
    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="(("))
    with pytest.raises(ValueError, match=r"structured_outputs\.regex does not compile"):
        llm.generate("x", params, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
