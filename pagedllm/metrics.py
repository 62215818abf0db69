"""Serving metrics: Prometheus collectors for the API server, and the periodic stats line.

Queue sizes, KV cache use and token counts are read from the engine's latest stats snapshot
whenever /metrics is scraped (a custom collector), so nothing has to be updated per step.
Per-request latencies are histograms observed when each request finishes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from pagedllm.outputs import PoolingRequestOutput, RequestOutput

if TYPE_CHECKING:
    from pagedllm.core.spec_decode import SpecDecodingStats
    from pagedllm.engine.async_engine import AsyncLLMEngine
    from pagedllm.engine.stats import EngineStats

logger = logging.getLogger(__name__)

PREFIX = "pagedllm:"
# vLLM's buckets, so that dashboards built for it read ours the same way.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)


class ServerMetrics:
    """The metrics of one server, in a registry of their own (two servers in one process do not
    share counters)."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engine, model_name))
        labels = ["model_name"]

        def histogram(name: str, documentation: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(
                PREFIX + name, documentation, labels, buckets=buckets, registry=self.registry
            ).labels(model_name)

        self.ttft = histogram(
            "time_to_first_token_seconds", "Time from arrival to the first output token", TTFT_BUCKETS
        )
        self.tpot = histogram(
            "time_per_output_token_seconds",
            "Mean time between output tokens after the first, per request",
            TPOT_BUCKETS,
        )
        self.e2e_latency = histogram(
            "e2e_request_latency_seconds", "Time from arrival to the last output token", E2E_BUCKETS
        )
        self.request_success = Counter(
            PREFIX + "request_success",
            "Requests finished, by the first output's finish reason (error: never ran)",
            [*labels, "finished_reason"],
            registry=self.registry,
        )
        self.model_name = model_name

    def observe_finished(self, output: RequestOutput | PoolingRequestOutput) -> None:
        """Record a finished request's latencies (AsyncLLMEngine's on_request_finished hook)."""
        if not isinstance(output, RequestOutput):  # a pooling model's: no tokens, no latencies
            self.request_success.labels(self.model_name, "stop").inc()
            return
        reason = "error" if output.error else output.outputs[0].finish_reason
        self.request_success.labels(self.model_name, reason).inc()
        metrics = output.metrics
        if metrics is None or metrics.first_token_time is None:
            return  # ended without running (output.error)
        self.ttft.observe(metrics.first_token_time - metrics.arrival_time)
        end = metrics.last_token_time or metrics.first_token_time
        self.e2e_latency.observe(end - metrics.arrival_time)
        num_tokens = max(len(o.token_ids) for o in output.outputs)
        if num_tokens > 1:
            self.tpot.observe((end - metrics.first_token_time) / (num_tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)


# Read from each engine core's stats, one sample per core labelled ``engine`` (its data-parallel
# rank, as vLLM labels them): name -> (help, value).
_ENGINE_GAUGES: dict[str, tuple[str, Callable[[EngineStats], float]]] = {
    "num_requests_running": ("Requests running on the device", lambda s: s.num_running),
    "num_requests_waiting": ("Requests waiting to be scheduled", lambda s: s.num_waiting),
    "num_requests_swapped": ("Requests swapped out to the CPU", lambda s: s.num_swapped),
    "gpu_cache_usage_perc": ("Fraction of device KV cache blocks in use", lambda s: s.gpu_cache_usage),
    "num_gpu_blocks": ("Device KV cache blocks", lambda s: s.num_gpu_blocks),
    "num_free_gpu_blocks": ("Free device KV cache blocks", lambda s: s.num_free_gpu_blocks),
    "num_cpu_blocks": ("CPU swap space blocks", lambda s: s.num_cpu_blocks),
    "num_free_cpu_blocks": ("Free CPU swap space blocks", lambda s: s.num_free_cpu_blocks),
    "prefix_cache_hit_rate": (
        "Fraction of prompt tokens found in the prefix cache",
        lambda s: s.prefix_cache_hit_rate,
    ),
}
_ENGINE_COUNTERS: dict[str, tuple[str, Callable[[EngineStats], float]]] = {
    "prompt_tokens": ("Prefill tokens computed", lambda s: s.num_prefill_tokens),
    "generation_tokens": ("Tokens generated", lambda s: s.num_generation_tokens),
    "num_preemptions": (
        "Requests preempted (recompute or swap)",
        lambda s: s.num_preemptions_recompute + s.num_preemptions_swap,
    ),
}


class EngineCollector(Collector):
    """Gauges and counters read from the engine's latest stats snapshot at scrape time: each
    engine core's (``engine`` label; with data parallelism, sum or average over it in PromQL),
    and the frontend's request counters."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        engine_stats = list(enumerate(self.engine.engine_stats))
        labels = ["model_name", "engine"]
        for kind, metrics in ((GaugeMetricFamily, _ENGINE_GAUGES), (CounterMetricFamily, _ENGINE_COUNTERS)):
            for name, (documentation, value_of) in metrics.items():
                family = kind(PREFIX + name, documentation, labels=labels)
                for index, stats in engine_stats:
                    family.add_metric([self.model_name, str(index)], value_of(stats))
                yield family
        counters = {
            "num_aborted_requests": (
                "Requests aborted while running or queued",
                self.engine.num_aborted_requests,
            ),
            "num_failed_requests": (
                "Requests failed because a model step raised whenever they ran",
                self.engine.num_failed_requests,
            ),
        }
        for name, (documentation, value) in counters.items():
            family = CounterMetricFamily(PREFIX + name, documentation, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family
        spec_decoding = self.engine.stats.spec_decoding
        if spec_decoding is not None:
            yield from self._spec_decoding(spec_decoding)

    def _spec_decoding(self, spec: SpecDecodingStats) -> Iterator[CounterMetricFamily]:
        """vLLM's speculative decoding counters; acceptance rate = accepted / draft tokens, mean
        acceptance length = 1 + accepted / drafts (rates of these, over a window, in PromQL)."""
        counters = {
            "spec_decode_num_drafts": ("Verifications of a request's drafts", spec.num_drafts),
            "spec_decode_num_draft_tokens": ("Draft tokens verified", spec.num_draft_tokens),
            "spec_decode_num_accepted_tokens": ("Draft tokens accepted", spec.num_accepted_tokens),
        }
        for name, (documentation, value) in counters.items():
            family = CounterMetricFamily(PREFIX + name, documentation, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family
        family = CounterMetricFamily(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each position of the drafts",
            labels=["model_name", "position"],
        )
        for position, value in enumerate(spec.num_accepted_tokens_per_pos):
            family.add_metric([self.model_name, str(position)], value)
        yield family


class StatsLogger:
    """Logs one line of throughput and queue state every ``interval`` seconds while busy."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._last: EngineStats | None = None
        self._last_time = time.monotonic()

    def log(self, stats: EngineStats) -> None:
        now = time.monotonic()
        last, elapsed = self._last, max(now - self._last_time, 1e-9)
        self._last, self._last_time = stats, now
        if last is None:
            return
        prompt_tokens = stats.num_prefill_tokens - last.num_prefill_tokens
        generation_tokens = stats.num_generation_tokens - last.num_generation_tokens
        if not (prompt_tokens or generation_tokens or stats.num_running or stats.num_waiting):
            return  # idle: say nothing
        logger.info(
            "prompt throughput %.1f tok/s, generation throughput %.1f tok/s, running %d, waiting %d, "
            "swapped %d, KV cache usage %.1f%%",
            prompt_tokens / elapsed,
            generation_tokens / elapsed,
            stats.num_running,
            stats.num_waiting,
            stats.num_swapped,
            100 * stats.gpu_cache_usage,
        )
        spec, last_spec = stats.spec_decoding, last.spec_decoding
        if spec is not None and last_spec is not None and spec.num_drafts > last_spec.num_drafts:
            num_drafts = spec.num_drafts - last_spec.num_drafts
            num_draft_tokens = spec.num_draft_tokens - last_spec.num_draft_tokens
            num_accepted = spec.num_accepted_tokens - last_spec.num_accepted_tokens
            logger.info(
                "speculative decoding: acceptance rate %.1f%%, mean acceptance length %.2f, drafts %d",
                100 * num_accepted / max(num_draft_tokens, 1),
                1 + num_accepted / num_drafts,
                num_drafts,
            )
