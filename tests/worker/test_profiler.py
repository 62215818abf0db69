"""Each rank profiles its own steps (``LLM.start_profile`` / ``stop_profile``): the device
timeline's arithmetic, the summaries in rank order, the traces kept, and misuse refused."""

from __future__ import annotations

import json

import pytest
from transformers import LlamaConfig

from pagedllm import LLM, SamplingParams
from pagedllm.entrypoints.bench.step_profile import profile_steps_of
from pagedllm.worker.profiler import GAP_THRESHOLD_US, TRACE_DIR_ENV, device_timeline, step_timeline

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def test_device_timeline_merges_overlaps_and_counts_only_real_gaps():
    intervals = [
        (100.0, 140.0),
        (0.0, 30.0),
        (20.0, 50.0),  # overlaps the first (another stream): busy 0-50
        (53.0, 60.0),  # a 3 us seam: idle, not a gap
        (60.0, 70.0),  # touching: no idle at all
        (150.0, 150.0 + GAP_THRESHOLD_US),
        (110.0, 120.0),  # inside 100-140
    ]
    t = device_timeline(intervals)
    assert t.num_events == 7
    assert t.busy_us == pytest.approx(50 + 17 + 40 + GAP_THRESHOLD_US)
    assert t.span_us == pytest.approx(150 + GAP_THRESHOLD_US)
    assert t.idle_us == pytest.approx(3 + 30 + 10)
    # 70 -> 100 (30 us) and 140 -> 150 (10 us, the threshold itself); the 3 us seam is not one.
    assert t.num_gaps == 2
    assert t.largest_gaps_us == (30.0, 10.0)
    assert t.gaps_us == pytest.approx(40.0)


def test_device_timeline_of_nothing():
    t = device_timeline([])
    assert (t.num_events, t.busy_us, t.span_us, t.num_gaps, t.largest_gaps_us) == (0, 0.0, 0.0, 0, ())


class FakeEvent:
    """A completed CUDA event at ``t`` ms."""

    def __init__(self, t: float) -> None:
        self.t = t

    def elapsed_time(self, other: FakeEvent) -> float:
        return other.t - self.t


def test_step_timeline_reads_the_device_s_waits_between_steps():
    # Steps of 2 ms on the device; the third starts 0.5 ms after the second ends (the host was
    # late), the second was queued before the first ended (no wait).
    device = [
        (FakeEvent(0.0), FakeEvent(2.0)),
        (FakeEvent(2.0), FakeEvent(4.0)),
        (FakeEvent(4.5), FakeEvent(6.5)),
    ]
    host = [(0.0, 0.0003), (0.001, 0.0012), (0.0045, 0.0049)]
    t = step_timeline(host, device)
    assert t["num_steps"] == 3
    assert t["device_step_ms"] == pytest.approx(2.0)
    assert t["device_wait_total_ms"] == pytest.approx(0.5)
    assert t["device_wait_ms"] == pytest.approx(0.5)  # the median of (0, 0.5) is the upper one
    assert t["device_total_ms"] == pytest.approx(6.5)
    assert t["host_issue_ms"] == pytest.approx(0.3)
    assert t["host_period_ms"] == pytest.approx(3.5)
    # The CPU: host marks only.
    assert set(step_timeline(host, [])) == {"num_steps", "host_issue_ms", "host_period_ms"}
    assert step_timeline([], []) == {"num_steps": 0}


def test_one_rank_profiles_its_steps_and_keeps_the_trace(make_tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv(TRACE_DIR_ENV, str(tmp_path / "traces"))
    _, model_config = make_tiny_model(LlamaConfig)
    llm = LLM(model_config.model, device="cpu", dtype="float32", kv_cache_memory=1 << 22)
    with pytest.raises(RuntimeError, match="no profile is running"):
        llm.stop_profile()
    llm.start_profile()
    with pytest.raises(RuntimeError, match="already running"):
        llm.start_profile()
    llm.generate(prompt_token_ids=[[1, 2, 3, 4]], sampling_params=GREEDY, use_tqdm=False)
    (summary,) = llm.stop_profile()
    assert summary["rank"] == 0
    # The CPU has no device events; the table lists the host operations the model ran.
    assert summary["num_events"] == 0
    assert "aten::" in summary["table"]
    with open(summary["trace"]) as f:
        trace = json.load(f)
    names = {event.get("name") for event in trace["traceEvents"]}
    assert any(name and name.startswith("aten::") for name in names)
    # Each step the engine ran was marked: a prompt step and 5 decodes.
    assert summary["steps"]["num_steps"] == 6 and summary["steps"]["host_issue_ms"] > 0
    # A profile can start again after a stop; each keeps its own trace.
    llm.start_profile()
    (again,) = llm.stop_profile()
    assert again["trace"] != summary["trace"]
    # Without the torch profiler: the step marks only, no table, no trace.
    llm.start_profile(torch_profiler=False)
    llm.generate(prompt_token_ids=[[1, 2, 3, 4]], sampling_params=GREEDY, use_tqdm=False)
    (marks,) = llm.stop_profile()
    assert set(marks) == {"rank", "steps"} and marks["steps"]["num_steps"] == 6


def test_bench_profile_reports_every_step_per_rank(make_tiny_model):
    _, model_config = make_tiny_model(LlamaConfig)
    llm = LLM(model_config.model, device="cpu", dtype="float32", kv_cache_memory=1 << 22)
    engine = llm.llm_engine
    engine.add_request("r", sampling_params=GREEDY, prompt_token_ids=[1, 2, 3])
    profiled = profile_steps_of(engine, 3)
    assert profiled["num_steps"] == 3 and profiled["wall_ms_per_step"] > 0
    assert [r["rank"] for r in profiled["ranks"]] == [0]
    assert profiled["ranks"][0]["steps"]["num_steps"] == 3
    assert "aten::" in profiled["tables"][0]
    events = profile_steps_of(engine, 2, "events")
    assert events["tables"] == {} and events["ranks"][0]["steps"]["num_steps"] == 2
    with pytest.raises(ValueError, match="profile mode 'nsys'"):
        profile_steps_of(engine, 1, "nsys")


def test_every_rank_profiles_itself(make_tiny_model):
    _, model_config = make_tiny_model(LlamaConfig, num_attention_heads=4, num_key_value_heads=2)
    llm = LLM(model_config.model, device="cpu", swap_space=0.01, tensor_parallel_size=2)
    try:
        llm.start_profile()
        llm.generate(prompt_token_ids=[[1, 2, 3, 4]], sampling_params=GREEDY, use_tqdm=False)
        summaries = llm.stop_profile()
        assert [s["rank"] for s in summaries] == [0, 1]
        assert [s["steps"]["num_steps"] for s in summaries] == [6, 6]
        # Each rank ran the model: its gloo all-reduces are in its own table.
        for summary in summaries:
            assert "aten::" in summary["table"]
            assert "c10d::allreduce_" in summary["table"]
    finally:
        llm.llm_engine.shutdown()
