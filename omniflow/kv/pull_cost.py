"""Pull or recompute: whether fetching a prefix's KV pages from another replica beats
prefilling those tokens here.

    pull_s      = latency_s + nbytes / link_rate        (bytes per second, measured)
    recompute_s = tokens / prefill_rate                 (tokens per second, measured)
    pull when pull_s < recompute_s

``link_rate`` is measured by every pull (bytes moved over the seconds from the fetch to the
last page written here, so it counts the copy into this replica's pages too) and
``latency_s`` by every prepare's round trip; ``prefill_rate`` by the engine's steps that
compute prompt tokens. Each is an exponentially weighted average, so the figures follow a
link that slows down or a host that gets busy; until the first sample they are the priors
given here. Prefill cost grows a little faster than linearly with the prefix (attention),
so the linear ``tokens / prefill_rate`` understates recompute for long prefixes: the model
leans towards recomputing, the safe side.
"""

from __future__ import annotations

import threading
from typing import NamedTuple


class RateMeter:
    """An exponentially weighted rate, units per second, from (units, seconds) samples.

    Units and seconds are averaged apart (their ratio is the rate), so a tiny sample cannot
    swing the rate as much as a large one. Safe to feed from several threads.
    """

    def __init__(self, prior: float, weight: float = 0.3) -> None:
        if prior <= 0 or not 0 < weight <= 1:
            raise ValueError(f"RateMeter: prior ({prior}) must be > 0, weight ({weight}) in (0, 1]")
        self.prior, self.weight = prior, weight
        self.samples = 0
        self._units = 0.0
        self._seconds = 0.0
        self._lock = threading.Lock()

    def add(self, units: float, seconds: float) -> None:
        if units <= 0 or seconds <= 0:
            return  # nothing measured
        with self._lock:
            w = 1.0 if self.samples == 0 else self.weight
            self._units += w * (units - self._units)
            self._seconds += w * (seconds - self._seconds)
            self.samples += 1

    @property
    def rate(self) -> float:
        with self._lock:
            return self.prior if self.samples == 0 else self._units / self._seconds


class Decision(NamedTuple):
    pull: bool
    pull_s: float
    recompute_s: float


class PullCost:
    """The cost model; ``link`` and ``latency`` are fed by pulls, ``prefill`` by the engine.

    Priors: a 1 GB/s link with 1 ms round trips, and 1,000 prefill tokens/s (a small model
    on a CPU); each is replaced by measurements from the first sample on.
    """

    def __init__(
        self,
        prefill: RateMeter | None = None,
        link_prior: float = 1e9,
        latency_prior: float = 1e-3,
    ) -> None:
        self.prefill = prefill or RateMeter(1e3)
        self.link = RateMeter(link_prior)
        # A round trip is one "unit": the rate is round trips per second.
        self._round_trips = RateMeter(1 / latency_prior)

    @property
    def latency_s(self) -> float:
        return 1 / self._round_trips.rate

    def add_round_trip(self, seconds: float) -> None:
        self._round_trips.add(1, seconds)

    def decide(self, nbytes: int, tokens: int) -> Decision:
        pull_s = self.latency_s + nbytes / self.link.rate
        recompute_s = tokens / self.prefill.rate
        return Decision(tokens > 0 and pull_s < recompute_s, pull_s, recompute_s)

    def figures(self) -> dict[str, float]:
        """The current estimates, for logs and benchmarks."""
        return {
            "link_bytes_per_s": self.link.rate,
            "latency_s": self.latency_s,
            "prefill_tokens_per_s": self.prefill.rate,
        }
