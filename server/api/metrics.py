"""Prometheus metrics (prometheus-client), one registry per app.

HTTP counts and latencies are recorded per request; engine figures (queue, batch, tokens) are read
from the engines when /metrics is scraped, by a custom collector.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector


class EngineCollector(Collector):
    def __init__(self, models: Callable[[], dict]) -> None:
        self.models = models  # read at each scrape: the registry replaces its dict as models load

    def collect(self):
        queue = GaugeMetricFamily("tinyserve_queue_size", "requests waiting for a batch slot", labels=["model"])
        batch = GaugeMetricFamily("tinyserve_batch_size", "requests in the running batch", labels=["model"])
        tokens = CounterMetricFamily("tinyserve_tokens_generated", "tokens generated", labels=["model"])
        steps = CounterMetricFamily("tinyserve_decode_steps", "batched decode steps", labels=["model"])
        prefills = CounterMetricFamily("tinyserve_prefill_passes", "batched prompt prefills", labels=["model"])
        drafted = CounterMetricFamily("tinyserve_draft_tokens", "draft tokens checked (speculation)", labels=["model"])
        agreed = CounterMetricFamily(
            "tinyserve_draft_tokens_agreed", "draft tokens the model agreed with", labels=["model"]
        )
        finished = CounterMetricFamily("tinyserve_generations", "finished generations", labels=["model", "reason"])
        prompt = CounterMetricFamily(
            "tinyserve_prompt_tokens", "prompt tokens admitted (paged KV pool)", labels=["model"]
        )
        cached = CounterMetricFamily(
            "tinyserve_prompt_tokens_cached", "prompt tokens read from cached blocks, not prefilled", labels=["model"]
        )
        held = GaugeMetricFamily("tinyserve_kv_blocks_held", "KV pool blocks held by requests", labels=["model"])
        for m in self.models().values():
            if m.engine is not None:
                queue.add_metric([m.id], m.engine.stats.queued)
                batch.add_metric([m.id], m.engine.stats.running)
                tokens.add_metric([m.id], m.engine.stats.tokens_generated)
                steps.add_metric([m.id], m.engine.stats.decode_steps)
                prefills.add_metric([m.id], m.engine.stats.prefill_passes)
                drafted.add_metric([m.id], m.engine.stats.draft_tokens)
                agreed.add_metric([m.id], m.engine.stats.draft_tokens_agreed)
                for reason, n in m.engine.stats.finished.items():
                    finished.add_metric([m.id, reason], n)
                if (blocks := m.engine.kv.pool) is not None:
                    prompt.add_metric([m.id], blocks.stats.prompt_tokens)
                    cached.add_metric([m.id], blocks.stats.cached_tokens)
                    held.add_metric([m.id], blocks.held())
        yield from (queue, batch, tokens, steps, prefills, drafted, agreed, finished, prompt, cached, held)


class Metrics:
    def __init__(self, models: Callable[[], dict]) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("tinyserve_requests", "HTTP requests", ["path", "status"], registry=self.registry)
        self.latency = Histogram(
            "tinyserve_request_seconds",
            "HTTP request latency, to the end of the response (a stream's last event)",
            ["path"],
            registry=self.registry,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
        )
        self.registry.register(EngineCollector(models))
