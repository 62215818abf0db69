"""When a sequence ends by its tokens: EOS (unless ``ignore_eos``), a stop token id, ``max_tokens``,
the context limit.

The scheduler checks every sampled token as it appends it (``stop_status``, as vLLM's scheduler
does with ``check_stop``) and frees what ended at once. A token stop counts only from
``min_tokens`` outputs on, and beats the length limit reached by the same token. Stop strings need
text: the engine matches them (and a stop string completed by the token that reached the length
limit makes it a stop). Beam search weighs its candidates with the same rules before any is
appended.

``max_context_len`` is the most tokens a sequence may hold: max_model_len, or None with attention
sinks (the window slides and a sequence grows without bound).
"""

from __future__ import annotations

from pagedllm.core.request import Request, RequestStatus


def stop_status(
    request: Request, token_id: int, num_output_tokens: int, max_context_len: int | None
) -> RequestStatus | None:
    """The status the request ends with when ``token_id`` is its ``num_output_tokens``-th output,
    or None. Runs for every sampled token: written flat."""
    params = request.sampling_params
    if num_output_tokens >= params.min_tokens and (
        token_id in request.group.eos_token_ids or token_id in params.stop_token_ids
    ):
        return RequestStatus.FINISHED_STOPPED
    num_tokens = len(request.prompt_token_ids) + num_output_tokens
    max_tokens = params.max_tokens
    if (max_context_len is not None and num_tokens >= max_context_len) or (
        max_tokens is not None and num_output_tokens >= max_tokens
    ):
        return RequestStatus.FINISHED_LENGTH_CAPPED
    return None


def stop_reason(request: Request, token_id: int) -> int | None:
    """What a request stopped by ``token_id`` reports as its ``stop_reason``: the stop token id,
    None for EOS."""
    return None if token_id in request.group.eos_token_ids else token_id


def ends_with_samples_in_flight(request: Request, max_context_len: int | None) -> bool:
    """Whether the samples in flight take the request to its length limit (max_tokens or the
    context): no step after them is needed, and a token past the context has no slot."""
    max_tokens = request.sampling_params.max_tokens
    num_outputs = request.num_output_tokens + request.num_output_placeholders
    return (max_context_len is not None and request.num_computed_tokens >= max_context_len) or (
        max_tokens is not None and num_outputs >= max_tokens
    )


def sits_out(request: Request, max_context_len: int | None, first_stage_waits: bool) -> bool:
    """Whether a request with samples in flight stays out of the next step: that step needs them
    on the host first (a best_of request's fork, beam search's choice) or, with pipeline stages
    (``first_stage_waits``), on the first stage; or it needs no step after them."""
    return (
        first_stage_waits
        or request.needs_host_between_steps
        or ends_with_samples_in_flight(request, max_context_len)
    )
