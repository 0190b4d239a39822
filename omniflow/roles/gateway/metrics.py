"""The gateway's Prometheus metrics, in a registry of its own (one per gateway)."""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Metrics:
    def __init__(self, deployment: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = {"deployment": deployment}
        self.requests = Counter(
            "omniflow_gateway_requests",
            "HTTP requests answered, by route and status code",
            ["route", "code"],
            registry=self.registry,
        )
        self.failures = Counter(
            "omniflow_gateway_failures",
            "HTTP requests answered with an error, by route and status code",
            ["route", "code"],
            registry=self.registry,
        )
        self.inflight = Gauge(
            "omniflow_gateway_inflight",
            "requests in flight through the gateway",
            registry=self.registry,
        )
        self.latency = Histogram(
            "omniflow_gateway_latency_seconds",
            "end-to-end latency of model requests, to the last byte",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.ttft = Histogram(
            "omniflow_gateway_time_to_first_token_seconds",
            "time to the first output of a request",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.first_audio = Histogram(
            "omniflow_time_to_first_audio_seconds",
            "time from a request's arrival to its first audio chunk, by the role (and replica) "
            "that made it",
            ["route", "role", "replica"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.audio_rtf = Histogram(
            "omniflow_audio_real_time_factor",
            "wall time to a request's last audio chunk over the audio's duration (< 1: faster "
            "than real time), by the role (and replica) that made it",
            ["route", "role", "replica"],
            buckets=(0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10),
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "omniflow_gateway_prompt_tokens", "prompt tokens", registry=self.registry
        )
        self.completion_tokens = Counter(
            "omniflow_gateway_completion_tokens", "completion tokens", registry=self.registry
        )
        self.cached_tokens = Counter(
            "omniflow_gateway_cached_tokens",
            "prompt tokens served from the cache",
            registry=self.registry,
        )
        self.info = Gauge(
            "omniflow_gateway_info", "the deployment served", list(labels), registry=self.registry
        )
        self.info.labels(**labels).set(1)
        self._answered: dict[tuple[str, int], list[Counter]] = {}
        self.chat_latency = self.latency.labels("chat")
        self.chat_ttft = self.ttft.labels("chat")

    def answered(self, route: str, status: int) -> None:
        # labels() takes a lock and builds a key: the children are looked up once.
        counters = self._answered.get((route, status))
        if counters is None:
            code = str(status)
            counters = [self.requests.labels(route, code)]
            if status >= 400:
                counters.append(self.failures.labels(route, code))
            self._answered[(route, status)] = counters
        for counter in counters:
            counter.inc()

    def usage(self, usage: dict[str, int]) -> None:
        if usage:
            self.prompt_tokens.inc(usage.get("prompt_tokens", 0))
            self.completion_tokens.inc(usage.get("completion_tokens", 0))
            self.cached_tokens.inc(usage.get("cached_tokens", 0))

    def audio_clock(self, route: str, started: float) -> AudioClock:
        return AudioClock(self, route, started)

    def text(self) -> bytes:
        return generate_latest(self.registry)


class AudioClock:
    """One request's audio: the first chunk's time and the real-time factor, observed at
    its end, when the request's timings name the replica that made the audio."""

    def __init__(self, metrics: Metrics, route: str, started: float) -> None:
        self.metrics, self.route, self.started = metrics, route, started
        self.role = ""
        self.first = 0.0
        self.seconds = 0.0
        self.last = started

    def chunk(self, role: str, data: dict[str, Any], default_rate: int) -> None:
        pcm = data.get("audio_chunk")
        if not isinstance(pcm, (bytes, bytearray)):
            return
        now = time.perf_counter()
        if not self.role:
            self.role, self.first = role, now - self.started
        self.seconds += len(pcm) / 2 / int(data.get("sample_rate", default_rate))
        self.last = now

    def done(self, result: Any = None) -> None:
        """At the request's ``Result`` (its ``timings`` name each role's replica)."""
        if not self.role:
            return
        timings = getattr(result, "timings", None) or []
        replica = next((str(t.replica) for t in timings if t.role == self.role), "")
        labels = (self.route, self.role, replica)
        self.metrics.first_audio.labels(*labels).observe(self.first)
        if self.seconds > 0:
            self.metrics.audio_rtf.labels(*labels).observe(
                (self.last - self.started) / self.seconds
            )
