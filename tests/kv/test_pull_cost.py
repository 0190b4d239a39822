"""The pull-or-recompute cost model and the holder's one-time tokens."""

import pytest

from omniflow.kv.pull_cost import PullCost, RateMeter
from omniflow.kv.pull_tokens import EXPIRED, UNKNOWN, USED, PullRefused, PullTokens


def test_a_meter_starts_at_its_prior_and_follows_measurements():
    meter = RateMeter(prior=100.0, weight=0.5)
    assert meter.rate == 100.0
    meter.add(1_000, 2.0)
    assert meter.rate == 500.0  # the first sample replaces the prior
    meter.add(1_000, 0.5)  # units and seconds averaged apart: 1000 / 1.25
    assert meter.rate == pytest.approx(800.0)
    meter.add(0, 1.0)  # nothing moved: no sample
    assert meter.samples == 2
    with pytest.raises(ValueError, match="prior"):
        RateMeter(prior=0)


def decide_with(link_bytes_per_s, prefill_tokens_per_s, nbytes, tokens, latency_s=0.001):
    cost = PullCost()
    cost.link.add(link_bytes_per_s, 1.0)
    cost.prefill.add(prefill_tokens_per_s, 1.0)
    cost.add_round_trip(latency_s)
    return cost.decide(nbytes, tokens)


def test_a_slow_link_recomputes_and_a_fast_one_pulls():
    # 2,048 tokens of 64 kB of KV each: 128 MiB.
    nbytes, tokens = 2048 * 65536, 2048
    slow = decide_with(10e6, 4_000, nbytes, tokens)  # 10 MB/s: 13 s against 0.5 s
    assert not slow.pull and slow.pull_s > slow.recompute_s
    fast = decide_with(10e9, 4_000, nbytes, tokens)  # 10 GB/s: 14 ms
    assert fast.pull
    assert fast.pull_s == pytest.approx(0.001 + nbytes / 10e9)
    assert fast.recompute_s == pytest.approx(tokens / 4_000)


def test_round_trips_count_and_nothing_to_recompute_never_pulls():
    far = decide_with(10e9, 4_000, 1 << 20, 64, latency_s=0.5)  # 16 ms of prefill vs 0.5 s
    assert not far.pull and far.pull_s > 0.5
    assert not decide_with(10e9, 4_000, 0, 0).pull


def test_the_engine_measures_prefill_for_the_model():
    prefill = RateMeter(prior=1e3)
    cost = PullCost(prefill=prefill)
    prefill.add(50_000, 1.0)  # what an engine's steps feed it
    assert cost.figures()["prefill_tokens_per_s"] == 50_000


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_a_token_opens_its_grant_once():
    tokens = PullTokens(ttl_s=5.0, clock=Clock())
    grant = tokens.grant([3, 4], 8)
    assert len(tokens) == 1 and len(grant.token) == 32
    assert tokens.take(grant.token) == grant
    with pytest.raises(PullRefused, match="already used") as again:
        tokens.take(grant.token)
    assert again.value.code == USED
    with pytest.raises(PullRefused, match="not one this replica gave out") as wrong:
        tokens.take("f" * 32)
    assert wrong.value.code == UNKNOWN
    assert len(tokens) == 0


def test_a_token_past_its_deadline_expires_swept_or_not():
    clock = Clock()
    tokens = PullTokens(ttl_s=5.0, clock=clock)
    swept, taken, alive = tokens.grant([1], 4), tokens.grant([2], 4), tokens.grant([5], 4)
    clock.now = 4.0
    alive = tokens.grant([6], 4)
    clock.now = 6.0
    with pytest.raises(PullRefused, match="expired") as late:
        tokens.take(taken.token)  # not swept yet: refused all the same
    assert late.value.code == EXPIRED
    assert tokens.expired() == []  # the take swept the other two of its time with it
    with pytest.raises(PullRefused) as also:
        tokens.take(swept.token)
    assert also.value.code == EXPIRED
    assert tokens.drain() == [alive]
    with pytest.raises(ValueError, match="ttl_s"):
        PullTokens(ttl_s=0)
