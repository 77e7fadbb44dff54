"""GET /metrics: what a serving system is judged by, in Prometheus' text format.

The engine's gauges and cumulative counts are read from its latest `EngineStats` at
scrape time (a custom collector: the engine keeps the numbers, we only show them);
the latency histograms are observed once per finished request.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from roseinfer.engine.outputs import EngineStats, RequestOutput

# Seconds; wide enough for a CPU serving GPT-2 small under load.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class EngineStatsCollector(Collector):
    def __init__(self, read_stats: Callable[[], EngineStats]) -> None:
        self.read_stats = read_stats

    def collect(self) -> Iterator[Metric]:
        s = self.read_stats()
        gauges = {
            "rose_num_requests_running": ("requests in the running batch", s.num_running),
            "rose_num_requests_waiting": ("requests waiting to be scheduled", s.num_waiting),
            "rose_kv_blocks_used": ("KV blocks held by live requests", s.num_kv_blocks_used),
            "rose_kv_blocks_total": ("KV blocks in the pool", s.num_kv_blocks),
            "rose_kv_pool_bytes": ("bytes of the KV pool", s.kv_pool_bytes),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        counters = {
            "rose_prefix_cache_queries": ("KV blocks looked up", s.prefix_cache_queries),
            "rose_prefix_cache_hits": ("KV blocks found in the prefix cache", s.prefix_cache_hits),
            "rose_preemptions": ("requests preempted to free blocks", s.num_preemptions),
            "rose_prompt_tokens": ("prompt tokens admitted", s.prompt_tokens),
            "rose_generation_tokens": ("tokens generated", s.generation_tokens),
        }
        if s.speculative is not None:  # vLLM's names (vllm:spec_decode_*), rose's prefix
            spec = s.speculative
            counters["rose_spec_decode_num_drafts"] = (
                "verify steps that carried drafted tokens",
                spec.num_drafts,
            )
            counters["rose_spec_decode_num_draft_tokens"] = (
                "tokens drafted",
                spec.num_draft_tokens,
            )
            counters["rose_spec_decode_num_accepted_tokens"] = (
                "drafted tokens the model accepted",
                spec.num_accepted_tokens,
            )
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(name, doc, value=value)


class ServerMetrics:
    """One registry per server (not prometheus_client's global one), so several servers
    can live in one process, as in tests."""

    def __init__(self, read_stats: Callable[[], EngineStats]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(EngineStatsCollector(read_stats))
        hist = dict(registry=self.registry, buckets=LATENCY_BUCKETS)
        self.ttft = Histogram("rose_time_to_first_token_seconds", "arrival to first token", **hist)
        self.tpot = Histogram(
            "rose_time_per_output_token_seconds", "(e2e - TTFT) / (tokens - 1)", **hist
        )
        self.e2e = Histogram("rose_e2e_request_latency_seconds", "arrival to finish", **hist)
        self.finished = Counter(
            "rose_requests_finished", "requests finished", ["finish_reason"], registry=self.registry
        )
        self.rejected = Counter(
            "rose_requests_rejected",
            "requests turned away (503: queue full)",
            registry=self.registry,
        )

    def observe_finished(self, output: RequestOutput) -> None:
        """Called by the engine thread for every finished request (prometheus_client's
        metrics are thread-safe)."""
        self.finished.labels(output.finish_reason).inc()
        if output.finish_reason == "abort" or output.first_token_time is None:
            return
        ttft = output.first_token_time - output.arrival_time
        e2e = output.finish_time - output.arrival_time
        self.ttft.observe(ttft)
        self.e2e.observe(e2e)
        if len(output.token_ids) > 1:
            self.tpot.observe((e2e - ttft) / (len(output.token_ids) - 1))
