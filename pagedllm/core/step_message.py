"""The step's message: each scheduled request written into the SchedulerOutput (in full for
workers that hold no row for it, else as a diff), and its progress advanced."""

from __future__ import annotations

import time

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request, new_request_data
from pagedllm.step_io import SchedulerOutput


def describe_step(scheduled: list[Request], out: SchedulerOutput, kv: KVCacheManager) -> int:
    """Write each scheduled request into the step's message (in full, or as a diff), then
    advance its progress: the step's tokens count as computed from now on, and a request
    that reaches its end holds a placeholder for the token the step samples. Returns the tokens
    computed by prefills (prompts, and outputs recomputed after preemption)."""
    num_prefill_tokens = 0
    cached = out.scheduled_cached_reqs
    num_scheduled_tokens = out.num_scheduled_tokens
    now = time.time()
    windowed = kv.sliding_window is not None
    for request in scheduled:
        req_id = request.req_id
        if windowed and (request.resend or kv.has_unsent_blocks(request)):
            out.num_dropped_tokens[req_id] = kv.get_num_dropped_tokens(request)
        if request.resend:
            request.resend = False
            out.scheduled_new_reqs.append(
                new_request_data(request, kv.get_block_ids(request), kv.get_state_slot(request))
            )
            kv.mark_sent(request)
        else:
            cached.req_ids.append(req_id)
            cached.block_table_diffs.append(kv.take_block_table_diff(request))
            cached.num_computed_tokens.append(request.num_computed_tokens)
            if request.num_output_placeholders > 1:  # drafts in flight, counted as accepted
                out.optimistic_req_ids.add(req_id)
        num_new_tokens = num_scheduled_tokens[req_id]
        num_computed_tokens = request.num_computed_tokens
        num_prompt_tokens = len(request.prompt_token_ids)
        if num_computed_tokens < num_prompt_tokens or (
            num_new_tokens > 1 and req_id not in out.scheduled_spec_decode_tokens
        ):
            num_prefill_tokens += num_new_tokens
        num_computed_tokens += num_new_tokens
        request.num_computed_tokens = num_computed_tokens
        num_known_tokens = num_prompt_tokens + len(request.output_token_ids)
        # A step that reaches the end samples a token; one that runs past it by drafts counts
        # them as accepted until its output says otherwise (update_from_output takes back the
        # rejected ones), so that a step scheduled before that output continues after them.
        if num_computed_tokens >= num_known_tokens + request.num_output_placeholders:
            request.num_output_placeholders = num_computed_tokens - num_known_tokens + 1
        if request.first_scheduled_time is None:
            request.first_scheduled_time = now
    return num_prefill_tokens
