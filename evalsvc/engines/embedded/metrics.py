"""Prometheus metrics of the embedded engine, under SGLang's metric names."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class _EngineCollector:
    def __init__(self, engine) -> None:
        self.engine = engine

    def collect(self):
        sched = self.engine.scheduler
        if sched is None:
            return
        s = sched.stats
        labels = {"model_name": self.engine.args.served_model_name or "default"}

        def counter(name, doc, value):
            m = CounterMetricFamily(name, doc, labels=list(labels))
            m.add_metric(list(labels.values()), value)
            return m

        def gauge(name, doc, value):
            m = GaugeMetricFamily(name, doc, labels=list(labels))
            m.add_metric(list(labels.values()), value)
            return m

        yield counter("sglang:prompt_tokens", "Prefill tokens processed.", s.prompt_tokens)
        yield counter("sglang:generation_tokens", "Generated tokens.", s.generation_tokens)
        yield counter("sglang:cached_tokens", "Prompt tokens served from the prefix cache.",
                      s.cached_tokens)
        yield counter("sglang:num_requests", "Requests received.", s.num_requests)
        yield gauge("sglang:num_running_reqs", "Requests running.", s.num_running)
        yield gauge("sglang:num_queue_reqs", "Requests waiting.", s.num_waiting)
        yield gauge("sglang:token_usage", "Fraction of the KV token pool in use.",
                    s.kv_used / max(1, self.engine.args.max_total_tokens))
        yield gauge("sglang:mamba_usage", "Fraction of the state slots in use.",
                    s.states_used / max(1, self.engine.args.max_mamba_cache_size))
        total = s.prompt_tokens
        yield gauge("sglang:cache_hit_rate", "Cached prompt tokens / prompt tokens.",
                    s.cached_tokens / total if total else 0.0)
        if sched.spec_steps:
            length = s.avg_spec_accept_length or 0.0
            rate = (s.spec_correct_drafts / (s.spec_verify_ct * sched.spec_steps)
                    if s.spec_verify_ct else 0.0)
            yield gauge("sglang:spec_accept_length", "Committed tokens per verify step.", length)
            yield gauge("sglang:spec_accept_rate", "Accepted drafts / proposed drafts.", rate)
        yield counter("evalsvc_engine:hicache_backups", "Tree nodes written to the host tier.",
                      s.host_backups)
        yield counter("evalsvc_engine:hicache_loads", "States loaded back from the host tier.",
                      s.host_loads)


def render(engine) -> bytes:
    registry = CollectorRegistry()
    registry.register(_EngineCollector(engine))
    return generate_latest(registry)
