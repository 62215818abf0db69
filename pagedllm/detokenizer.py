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

from pagedllm.core.request import Request
from pagedllm.tokenizer import Tokenizer

# Tokens of context before the first new one: enough for every tokenizer's merges and spacing.
_INITIAL_CONTEXT = 5


def init_detokenizer_state(seq: Request) -> None:
    seq.read_offset = seq.num_prompt_tokens
    seq.prefix_offset = max(seq.read_offset - _INITIAL_CONTEXT, 0)


def decode_all(
    tokenizer: Tokenizer,
    seq: Request,
    num_tokens: int,
    skip_special_tokens: bool,
    spaces_between_special_tokens: bool,
) -> str:
    """The text of the first ``num_tokens`` output tokens in one go, decoded after the same prompt
    context as the incremental path starts from (so both give the same text)."""
    start = max(seq.num_prompt_tokens - _INITIAL_CONTEXT, 0)
    context = seq.get_token_ids_slice(start, seq.num_prompt_tokens)
    kwargs = _decode_kwargs(skip_special_tokens, spaces_between_special_tokens)
    prefix_text = tokenizer.decode(context, **kwargs)
    return tokenizer.decode(context + seq.output_token_ids[:num_tokens], **kwargs)[len(prefix_text) :]


def _decode_kwargs(skip_special_tokens: bool, spaces_between_special_tokens: bool) -> dict[str, bool]:
    kwargs = {"skip_special_tokens": skip_special_tokens}
    if not spaces_between_special_tokens:
        kwargs["spaces_between_special_tokens"] = False
    return kwargs


def decode_incrementally(
    tokenizer: Tokenizer,
    seq: Request,
    skip_special_tokens: bool,
    spaces_between_special_tokens: bool,
    end: int | None = None,
) -> str:
    """Append the text of the request's tokens up to ``end`` (default: all) to
    ``seq.output_text``; return that text."""
    end = seq.num_tokens if end is None else end
    window = seq.get_token_ids_slice(seq.prefix_offset, end)
    num_prefix = seq.read_offset - seq.prefix_offset
    kwargs = _decode_kwargs(skip_special_tokens, spaces_between_special_tokens)
    prefix_text = tokenizer.decode(window[:num_prefix], **kwargs)
    full_text = tokenizer.decode(window, **kwargs)
    if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
        return ""
    new_text = full_text[len(prefix_text) :]
    seq.prefix_offset = seq.read_offset
    seq.read_offset = end
    seq.output_text += new_text
    return new_text
