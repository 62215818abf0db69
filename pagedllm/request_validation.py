"""Checks a request against what this engine can do with it, before it is queued.

SamplingParams checks what it can alone (types, ranges, finite floats); what depends on the
engine is checked here: token ids against the vocabulary, ``n``/``best_of`` against
``max_num_seqs`` and the KV cache, ``min_tokens`` against the context, bad words tokenized. A
request that passes cannot make a step raise, so it cannot hurt the requests batched with it.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedllm.config import EngineConfig
from pagedllm.core.request import num_candidates
from pagedllm.sampling_params import SamplingParams, as_int_list
from pagedllm.structured_output import StructuredOutputManager
from pagedllm.tokenizer import Tokenizer


def validate_request(
    params: SamplingParams,
    prompt_token_ids: Sequence[int],
    config: EngineConfig,
    num_gpu_blocks: int,
    num_eos_token_ids: int,
    tokenizer: Tokenizer | None,
    structured_output_manager: StructuredOutputManager | None = None,
) -> list[int]:
    """The prompt's token ids as Python ints (cut to ``truncate_prompt_tokens``), after checking
    the request against the engine. Sets ``params.bad_words_token_ids`` and compiles
    ``params.structured_outputs`` (at once when the server compiled it before, off the loop).

    Raises:
        ValueError: naming the field, for anything this engine cannot run.
    """
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
    params.verify()  # again: a caller may have changed a field since it was made
    vocab_size = config.model_config.vocab_size
    token_ids = check_token_ids(prompt_token_ids, vocab_size, "prompt token id")
    if not token_ids:
        raise ValueError("prompt is empty: give at least one token")
    if params.truncate_prompt_tokens is not None:
        token_ids = token_ids[-params.truncate_prompt_tokens :]
    for field, ids in params.token_id_fields.items():
        check_token_ids(ids, vocab_size, field)
    params.bad_words_token_ids = _bad_words_token_ids(params, tokenizer, vocab_size)
    _compile_structured_outputs(params, structured_output_manager)
    _check_num_seqs(params, config.scheduler_config.max_num_seqs, vocab_size, num_eos_token_ids)
    _check_lengths(params, len(token_ids), config, num_gpu_blocks)
    return token_ids


def check_token_ids(token_ids: Sequence[int], vocab_size: int, field: str) -> list[int]:
    """``token_ids`` as Python ints (numpy and torch integers accepted), each in [0, vocab_size)."""
    ids = as_int_list(token_ids, field)
    for token_id in ids:
        if not 0 <= token_id < vocab_size:
            raise ValueError(f"{field} {token_id} is outside the vocabulary [0, {vocab_size})")
    return ids


def _bad_words_token_ids(
    params: SamplingParams, tokenizer: Tokenizer | None, vocab_size: int
) -> list[list[int]] | None:
    """Each bad word's token ids, alone and after a space (mid-sentence words carry it), as vLLM
    encodes them."""
    if not params.bad_words:
        return None
    if tokenizer is None:
        raise ValueError("bad_words needs a tokenizer, and this engine has none")
    sequences: list[list[int]] = []
    for word in params.bad_words:
        for text in (word, " " + word.lstrip()):
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            if ids and ids not in sequences:
                sequences.append(check_token_ids(ids, vocab_size, "bad_words token id"))
    return sequences


def _compile_structured_outputs(params: SamplingParams, manager: StructuredOutputManager | None) -> None:
    structured = params.structured_outputs
    if structured is None or structured.compiled_grammar is not None:
        return
    if manager is None:
        raise ValueError("structured_outputs needs a tokenizer, and this engine has none")
    structured.compiled_grammar = manager.compile(structured).result()


def _check_num_seqs(params: SamplingParams, max_num_seqs: int, vocab_size: int, num_eos: int) -> None:
    # A request's sequences are scheduled together: more than a step holds would never run, and
    # would block every request queued after it.
    if params.best_of > max_num_seqs:
        field = "best_of" if params.best_of > params.n else "n"
        raise ValueError(
            f"{field} must be at most max_num_seqs ({max_num_seqs}), the most sequences a step runs; "
            f"got {params.best_of}"
        )
    # Beam search keeps this many candidates per beam each step, from the top of the vocabulary.
    if params.use_beam_search and num_candidates(params.best_of, num_eos) > vocab_size:
        raise ValueError(
            f"best_of must be at most {vocab_size // num_candidates(1, num_eos)} with beam search on a "
            f"vocabulary of {vocab_size} tokens; got {params.best_of}"
        )


def _check_lengths(
    params: SamplingParams, num_prompt_tokens: int, config: EngineConfig, num_gpu_blocks: int
) -> None:
    max_model_len = config.model_config.max_model_len
    # A prompt over max_model_len is not refused here: the engine finishes it with an error. With
    # attention sinks, generation runs past it.
    limited = config.model_config.max_context_len is not None
    if (
        limited
        and params.min_tokens
        and num_prompt_tokens <= max_model_len < num_prompt_tokens + params.min_tokens
    ):
        raise ValueError(
            f"min_tokens must be at most {max(max_model_len - num_prompt_tokens, 0)} (max_model_len "
            f"{max_model_len} minus {num_prompt_tokens} prompt tokens); got {params.min_tokens}"
        )
    if params.best_of == 1:
        return  # the engine checked at start that one full-length sequence fits the cache
    # No sequence holds more blocks than one of max_model_len tokens (with sinks, far fewer).
    max_len = min(num_prompt_tokens + (params.max_tokens or max_model_len), max_model_len)
    block_size = config.scheduler_block_size
    # The prompt's full blocks are shared by every sequence; each holds its own blocks after them.
    num_shared = num_prompt_tokens // block_size
    num_blocks = num_shared + params.best_of * (-(-max_len // block_size) - num_shared)
    if num_blocks > num_gpu_blocks:
        raise ValueError(
            f"best_of must be smaller: {params.best_of} sequences of up to {max_len} tokens need "
            f"{num_blocks} KV blocks and the cache has {num_gpu_blocks}; lower n, best_of or max_tokens"
        )
