"""Every replica's engine and queue figures in the gateway's /metrics, one scrape per
deployment.

Each replica publishes its figures in its registry record at every heartbeat
(runtime/worker.py ``_heartbeat``: ``ActorRecord.stats``); the gateway already follows
those records (its Client's RegistryView), so a scrape reads them from memory: no request
to any replica, no socket of its own, and a replica that died or left is gone from the
next scrape with its record. Figures are at most one heartbeat (``[runtime] heartbeat_s``)
old. Labels: ``role`` and ``replica`` (and ``tier`` for KV pages). Every replica has
its queue depth, in-flight and served count; a model role (roles/base.py ``ModelActor``)
its model thread's running and waiting calls and compute seconds; a role running an LLM
engine (llm, the HunyuanImage-3 roles) the engine's KV, queue and step figures.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector

_LABELS = ["role", "replica"]
# stats key -> (metric name, kind, help); a key "NAME:TIER" feeds NAME with label tier.
_FIGURES: dict[str, tuple[str, str, str]] = {
    "queue_depth": (
        "omniflow_replica_queue_depth",
        "gauge",
        "requests waiting at a replica for a handler slot",
    ),
    "running": ("omniflow_engine_running_requests", "gauge", "sequences in the running batch"),
    "waiting": (
        "omniflow_engine_waiting_requests",
        "gauge",
        "sequences waiting for KV pages or a batch slot (preempted ones included)",
    ),
    "preemptions_total": (
        "omniflow_engine_preemptions",
        "counter",
        "running sequences preempted for KV pages",
    ),
    "prefix_hit_tokens_total": (
        "omniflow_engine_prefix_hit_tokens",
        "counter",
        "prompt tokens admitted from the prefix cache instead of computed",
    ),
    "prompt_tokens_computed_total": (
        "omniflow_engine_prompt_tokens_computed",
        "counter",
        "prompt tokens the model computed",
    ),
    "kv_pages_used": ("omniflow_kv_pages_used", "gauge", "KV cache pages in use, by tier"),
    "kv_pages_free": ("omniflow_kv_pages_free", "gauge", "KV cache pages free, by tier"),
    "kv_pages_cached": (
        "omniflow_kv_pages_cached",
        "gauge",
        "KV cache pages reachable through the prefix cache, by tier",
    ),
    "model_running": (
        "omniflow_model_running_calls",
        "gauge",
        "calls running on a replica's model thread",
    ),
    "model_waiting": (
        "omniflow_model_waiting_calls",
        "gauge",
        "calls waiting for a replica's model thread",
    ),
}
# stats keys NAME_count and NAME_sum -> a summary (metric name, help).
_SUMMARIES: dict[str, tuple[str, str]] = {
    "step_seconds": ("omniflow_engine_step_seconds", "time of the engine's model steps"),
    "compute_seconds": (
        "omniflow_model_compute_seconds",
        "time of the calls on a replica's model thread (its load and warm-up included)",
    ),
}


class RoleMetrics(Collector):
    """A prometheus_client collector over the records of a RegistryView."""

    def __init__(self, view: Any) -> None:
        self.view = view

    def collect(self) -> Iterator[Metric]:
        records = [r for r in self.view.all() if r.state == "ready"]
        inflight = GaugeMetricFamily(
            "omniflow_replica_inflight", "requests in flight at a replica", labels=_LABELS
        )
        served = CounterMetricFamily(
            "omniflow_replica_served", "requests a replica finished", labels=_LABELS
        )
        summaries = {
            key: SummaryMetricFamily(name, documentation, labels=_LABELS)
            for key, (name, documentation) in _SUMMARIES.items()
        }
        families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}
        for record in records:
            labels = [record.role, str(record.replica)]
            inflight.add_metric(labels, record.inflight)
            served.add_metric(labels, record.served)
            stats = record.stats
            for key, summary in summaries.items():
                if f"{key}_count" in stats:
                    summary.add_metric(labels, stats[f"{key}_count"], stats.get(f"{key}_sum", 0.0))
            for key, value in stats.items():
                name, _, tier = key.partition(":")
                figure = _FIGURES.get(name)
                if figure is None:
                    continue
                family = families.get(name)
                if family is None:
                    family = families[name] = _family(*figure, tiered=bool(tier))
                family.add_metric([*labels, tier] if tier else labels, value)
        yield inflight
        yield served
        yield from summaries.values()
        yield from families.values()


def _family(
    name: str, kind: str, documentation: str, tiered: bool
) -> GaugeMetricFamily | CounterMetricFamily:
    labels = [*_LABELS, "tier"] if tiered else _LABELS
    if kind == "counter":
        return CounterMetricFamily(name, documentation, labels=labels)
    return GaugeMetricFamily(name, documentation, labels=labels)
