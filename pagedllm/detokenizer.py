"""Incremental detokenization: text as tokens arrive, never splitting a UTF-8 character.

Decoding one token alone is wrong for most tokenizers (byte-level BPE splits characters over
tokens; SentencePiece drops a leading space at the start of a string). So each step decodes a
short window of recent tokens twice, with and without the new ones, and emits the difference:

    ids        ... p p p p p r r r n          p: prefix_offset.. (context only)
                           ^prefix ^read      r: read_offset..   (decoded, not yet emitted)
    new text = decode(ids[prefix:]) - decode(ids[prefix:read])

When the decoded tail ends in U+FFFD the new tokens are a partial character: nothing is emitted
and the offsets stay, so the next token completes it.
"""

from __future__ import annotations

from typing import Protocol

from pagedllm.tokenizer import Tokenizer

# Tokens of context before the first new one: enough for every tokenizer's merges and spacing.
_INITIAL_CONTEXT = 5


class DecodedSequence(Protocol):
    """An output sequence as the frontend holds it: its tokens, its text, and where the
    incremental decoder stands (offsets into prompt + output tokens)."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    prefix_offset: int
    read_offset: int


def init_detokenizer_state(seq: DecodedSequence) -> None:
    seq.read_offset = len(seq.prompt_token_ids)
    seq.prefix_offset = max(seq.read_offset - _INITIAL_CONTEXT, 0)


def decode_all(
    tokenizer: Tokenizer,
    seq: DecodedSequence,
    num_tokens: int,
    skip_special_tokens: bool,
    spaces_between_special_tokens: bool,
) -> str:
    """The text of the first ``num_tokens`` output tokens in one go, decoded after the same prompt
    context as the incremental path starts from (so both give the same text)."""
    context = seq.prompt_token_ids[-_INITIAL_CONTEXT:]
    kwargs = _decode_kwargs(skip_special_tokens, spaces_between_special_tokens)
    prefix_text = tokenizer.decode(context, **kwargs)
    return tokenizer.decode(context + seq.token_ids[:num_tokens], **kwargs)[len(prefix_text) :]


def _decode_kwargs(skip_special_tokens: bool, spaces_between_special_tokens: bool) -> dict[str, bool]:
    kwargs = {"skip_special_tokens": skip_special_tokens}
    if not spaces_between_special_tokens:
        kwargs["spaces_between_special_tokens"] = False
    return kwargs


def decode_incrementally(
    tokenizer: Tokenizer, seq: DecodedSequence, skip_special_tokens: bool, spaces_between_special_tokens: bool
) -> str:
    """Append the text of the sequence's newest tokens to ``seq.text``; return that text."""
    prompt = seq.prompt_token_ids
    num_prompt = len(prompt)
    end = num_prompt + len(seq.token_ids)
    if seq.prefix_offset >= num_prompt:
        window = seq.token_ids[seq.prefix_offset - num_prompt :]
    else:
        window = prompt[seq.prefix_offset :] + seq.token_ids
    num_prefix = seq.read_offset - seq.prefix_offset
    kwargs = _decode_kwargs(skip_special_tokens, spaces_between_special_tokens)
    prefix_text = tokenizer.decode(window[:num_prefix], **kwargs)
    full_text = tokenizer.decode(window, **kwargs)
    if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
        return ""
    new_text = full_text[len(prefix_text) :]
    seq.prefix_offset = seq.read_offset
    seq.read_offset = end
    seq.text += new_text
    return new_text
