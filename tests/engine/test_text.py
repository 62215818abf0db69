"""Incremental detokenization and stop conditions."""

import pytest

from pagedllm.detokenizer import decode_incrementally, init_detokenizer_state
from pagedllm.engine.output_processor import SequenceState
from pagedllm.engine.stop_checker import check_stop_strings
from pagedllm.sampling_params import SamplingParams

TEXTS = [
    "Hello there, how are you?",
    "café crème brûlée — €5, naïve résumé",
    "日本語のテキストと emoji 🎉🚀 mixed",
    "  leading spaces\nand\ttabs  ",
]


def make_request(prompt_token_ids: list[int]) -> SequenceState:
    return SequenceState(0, prompt_token_ids)


def stream(tokenizer, prompt: str, output_ids: list[int], **kwargs) -> tuple[SequenceState, list[str]]:
    seq = make_request(tokenizer(prompt)["input_ids"])
    init_detokenizer_state(seq)
    chunks = []
    for token_id in output_ids:
        seq.token_ids.append(token_id)
        chunks.append(decode_incrementally(tokenizer, seq, kwargs.get("skip", True), True))
    return seq, chunks


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_equals_full_decode_and_never_splits_a_character(smollm2_tokenizer, text):
    tokenizer = smollm2_tokenizer
    output_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    seq, chunks = stream(tokenizer, "Say something:", output_ids)
    assert all("\ufffd" not in chunk for chunk in chunks)
    assert "".join(chunks) == seq.text == tokenizer.decode(output_ids)
    # Where a character spans several tokens, the steps before its last token emit nothing.
    if any("\ufffd" in tokenizer.decode([token_id]) for token_id in output_ids):
        assert "" in chunks


def test_special_tokens_skipped_or_kept(smollm2_tokenizer):
    tokenizer = smollm2_tokenizer
    ids = tokenizer("Paris", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    seq, _ = stream(tokenizer, "Capital?", ids, skip=True)
    assert seq.text == "Paris"
    seq, _ = stream(tokenizer, "Capital?", ids, skip=False)
    assert seq.text == "Paris" + tokenizer.eos_token


def test_stop_string_across_token_boundaries_is_cut_from_the_text():
    params = SamplingParams(stop=["END"])
    seq = make_request([1])
    for i, piece in enumerate(["The answer", " is 4.", " E", "N", "D and more"]):
        seq.token_ids.append(10 + i)
        seq.text += piece
        stopped = check_stop_strings(seq, len(piece), params)
        if stopped:
            break
    assert stopped
    assert seq.text == "The answer is 4. "
    assert seq.stop_reason == "END"
    assert len(seq.token_ids) == 5


def test_include_stop_str_in_output_and_earliest_match_wins():
    params = SamplingParams(stop=["bb", "a"], include_stop_str_in_output=True)
    seq = make_request([1])
    seq.token_ids.append(5)
    seq.text = "xbba"
    assert check_stop_strings(seq, 4, params)
    assert seq.text == "xbb" and seq.stop_reason == "bb"


def test_a_stop_token_loses_its_text_unless_asked_and_stop_strings_wait_for_min_tokens():
    # The core stopped the request on token 42 (a stop token id) whose text is "<stop>".
    seq = make_request([1, 2])
    seq.token_ids.append(42)
    seq.text = "<stop>"
    seq.finish_reason = "stop"
    assert not check_stop_strings(seq, 6, SamplingParams(stop_token_ids=[42]))
    assert seq.text == ""

    seq = make_request([1, 2])
    seq.token_ids.append(42)
    seq.text = "<stop>"
    seq.finish_reason = "stop"
    params = SamplingParams(stop_token_ids=[42], include_stop_str_in_output=True)
    assert not check_stop_strings(seq, 6, params)
    assert seq.text == "<stop>"

    seq = make_request([1])
    seq.token_ids.append(5)
    seq.text = "END"
    assert not check_stop_strings(seq, 3, SamplingParams(stop=["END"], min_tokens=2))
    assert seq.text == "END" and seq.stop_reason is None
