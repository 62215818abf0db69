"""A pooling model's request in the scheduler: its prompt is computed in chunks, it is never
scheduled again once its last chunk is in flight (the vector is its one "sample"), other requests
are admitted meanwhile, and the step's pooler output ends it and frees its blocks."""

from pagedllm.config import SchedulerConfig
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.engine.pooling_output import POOLING_SAMPLING_PARAMS as POOLING
from pagedllm.step_io import ModelRunnerOutput

BLOCK_SIZE = 4
NUM_BLOCKS = 32


def _scheduler() -> Scheduler:
    config = SchedulerConfig(
        max_num_batched_tokens=8, max_num_seqs=4, max_model_len=64, enable_chunked_prefill=True
    )
    scheduler = Scheduler(config, BLOCK_SIZE, NUM_BLOCKS, 0)
    scheduler.kv_cache_manager.watermark_blocks = 0
    return scheduler


def _add(scheduler: Scheduler, prompt_len: int, t: float) -> Request:
    request = Request(scheduler.new_req_id(), list(range(prompt_len)), POOLING, BLOCK_SIZE, t, f"r{t}")
    scheduler.add_request(request)
    return request


def test_prompt_in_chunks_then_pooled_and_finished() -> None:
    scheduler = _scheduler()
    request = _add(scheduler, 20, 0.0)
    chunks = []
    for _ in range(3):
        out = scheduler.schedule()
        chunks.append(out.num_scheduled_tokens[request.req_id])
        if request.num_computed_tokens < 20:
            assert scheduler.update_from_output(out, ModelRunnerOutput()).pooled == []
    assert chunks == [8, 8, 4]
    assert request.num_output_placeholders == 1  # the vector in flight
    # Scheduled again before the last chunk's result is applied (asynchronous scheduling): the
    # request has nothing to compute, and a newcomer is admitted beside it.
    other = _add(scheduler, 6, 1.0)
    in_flight = scheduler.schedule()
    assert request.req_id not in in_flight.num_scheduled_tokens
    assert in_flight.num_scheduled_tokens == {other.req_id: 6}
    result = scheduler.update_from_output(out, ModelRunnerOutput(pooler_output={request.req_id: [0.5, 1.5]}))
    assert result.pooled == [(request, [0.5, 1.5])] and result.appended == []
    assert request.status == RequestStatus.FINISHED_STOPPED and request.output_token_ids == []
    result = scheduler.update_from_output(in_flight, ModelRunnerOutput(pooler_output={other.req_id: [1.0]}))
    assert result.pooled == [(other, [1.0])]
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv_cache_manager.get_num_free_gpu_blocks() == NUM_BLOCKS


def test_a_vector_for_a_request_aborted_meanwhile_is_dropped() -> None:
    scheduler = _scheduler()
    request = _add(scheduler, 5, 0.0)
    out = scheduler.schedule()
    scheduler.finish_requests([request], RequestStatus.FINISHED_ABORTED)
    assert (
        scheduler.update_from_output(out, ModelRunnerOutput(pooler_output={request.req_id: [1.0]})).pooled
        == []
    )
