"""The offline API's vLLM arguments: chat(tools, chat_template, continue_final_message), and a
too-long prompt refused before anything is queued. The rendered prompts are checked against the
tokenizer's own ``apply_chat_template``."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams

TEMPLATE = (
    "{% for tool in tools or [] %}[tool {{ tool.function.name }}]\n{% endfor %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% if not loop.last or add_generation_prompt %}"
    "</{{ m.role }}>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
PARAMS = SamplingParams(max_tokens=2, temperature=0.0)


@pytest.fixture(scope="module")
def llm(tiny_llama_with_tokenizer) -> LLM:
    return LLM(tiny_llama_with_tokenizer, device="cpu", max_model_len=64, num_kv_blocks=64)


def _expected_ids(tokenizer, messages, **kwargs) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_chat_renders_tools_with_the_given_template(llm):
    tokenizer = llm.get_tokenizer()
    messages = [{"role": "user", "content": "Weather?"}]
    [output] = llm.chat(messages, PARAMS, use_tqdm=False, chat_template=TEMPLATE, tools=TOOLS)
    expected = _expected_ids(
        tokenizer, messages, chat_template=TEMPLATE, tools=TOOLS, add_generation_prompt=True
    )
    assert output.prompt_token_ids == expected
    assert "[tool get_weather]" in tokenizer.decode(output.prompt_token_ids)


def test_chat_continues_the_final_message(llm):
    tokenizer = llm.get_tokenizer()
    messages = [{"role": "user", "content": "Count."}, {"role": "assistant", "content": "One, two,"}]
    [output] = llm.chat(
        messages,
        PARAMS,
        use_tqdm=False,
        chat_template=TEMPLATE,
        add_generation_prompt=False,
        continue_final_message=True,
    )
    expected = _expected_ids(tokenizer, messages, chat_template=TEMPLATE, continue_final_message=True)
    assert output.prompt_token_ids == expected
    assert tokenizer.decode(expected).endswith("<assistant>One, two,")
    with pytest.raises(ValueError, match="continue_final_message needs add_generation_prompt=False"):
        llm.chat(messages, PARAMS, chat_template=TEMPLATE, continue_final_message=True)


def test_a_prompt_longer_than_max_model_len_raises_before_anything_is_queued(llm):
    engine = llm.llm_engine
    added = []
    real_add = engine.add_request
    engine.add_request = lambda *args, **kwargs: added.append(args) or real_add(*args, **kwargs)
    try:
        with pytest.raises(ValueError, match="prompt 1 has 70 tokens, more than max_model_len=64"):
            llm.generate(prompt_token_ids=[[1, 2, 3], [5] * 70], sampling_params=PARAMS, use_tqdm=False)
        with pytest.raises(ValueError, match=r"prompt 0 has \d+ tokens, more than max_model_len=64"):
            llm.generate(["word " * 80], PARAMS, use_tqdm=False)
    finally:
        engine.add_request = real_add
    assert added == [] and not engine.has_unfinished_requests()
    # truncate_prompt_tokens makes it fit, as the engine will cut it.
    params = SamplingParams(max_tokens=2, temperature=0.0, truncate_prompt_tokens=8)
    [output] = llm.generate(prompt_token_ids=[[5] * 70], sampling_params=params, use_tqdm=False)
    assert output.error is None and len(output.prompt_token_ids) == 8
