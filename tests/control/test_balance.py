"""Load-balancing policies: exact, affine, load-steering and prefix-aware picks."""

from __future__ import annotations

import asyncio
from collections import Counter

import msgspec
import pytest

from omniflow.content import SUMMARY_META, content_hash, summary_key
from omniflow.control.balance import POLICIES, NoReplicaError, PickKey, make_policy, prefix_chain
from omniflow.messages import ActorRecord, Code


def replicas(count: int, role: str = "llm", inflight: dict[int, int] | None = None):
    inflight = inflight or {}
    return [
        ActorRecord(role, i, pid=1000 + i, endpoint=f"tcp://127.0.0.1:{7000 + i}", host="h",
                    inflight=inflight.get(i, 0))
        for i in range(count)
    ]  # fmt: skip


def sessions(count: int) -> list[PickKey]:
    return [PickKey(request_id=f"r{i}", session=f"session-{i}") for i in range(count)]


# ---------------------------------------------------------------- construction


def test_make_policy_names_the_unknown_policy_and_lists_the_valid_ones():
    with pytest.raises(ValueError) as error:
        make_policy("fastest", role="llm")
    message = str(error.value)
    assert "'fastest'" in message and "'llm'" in message
    for name in POLICIES:
        assert name in message
    with pytest.raises(ValueError, match="'round_robin'.*unexpected keyword"):
        make_policy("round_robin", role="llm", max_load_gap=3)
    assert make_policy("prefix_aware", role="llm", max_load_gap=3).max_load_gap == 3


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_no_live_replica_is_a_typed_error_naming_the_role(name):
    policy = make_policy(name, role="vision_encoder")
    with pytest.raises(NoReplicaError, match="'vision_encoder'") as error:
        policy.pick([], PickKey("r1", "s1", (1, 2)))
    assert error.value.role == "vision_encoder" and error.value.code is Code.UNAVAILABLE


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_picks_only_among_the_live_replicas(name):
    policy = make_policy(name, role="llm", seed=7)
    live = replicas(5)[1:4]
    for key in sessions(50):
        assert policy.pick(live, key) in live


# ---------------------------------------------------------------- round robin, random


def test_round_robin_is_exact():
    policy = make_policy("round_robin")
    group = replicas(3)
    picked = [policy.pick(group, key).replica for key in sessions(9)]
    assert picked == [0, 1, 2, 0, 1, 2, 0, 1, 2]


def test_random_spreads_and_is_reproducible_with_a_seed():
    group = replicas(4)
    policy, again = make_policy("random", seed=3), make_policy("random", seed=3)
    picks = [policy.pick(group).replica for _ in range(400)]
    assert picks == [again.pick(group).replica for _ in range(400)]
    assert all(60 <= count <= 140 for count in Counter(picks).values())


# ---------------------------------------------------------------- consistent hash


def test_consistent_hash_keeps_a_session_on_one_replica_across_producers():
    group = replicas(4)
    key = PickKey("r1", "alice")
    first = make_policy("consistent_hash").pick(group, key)
    # Another producer (another process) must route the session the same way.
    other = make_policy("consistent_hash")
    assert all(other.pick(group, key._replace(request_id=f"r{i}")) == first for i in range(20))
    # Shuffled registry order changes nothing.
    assert other.pick(list(reversed(group)), key) == first


def test_consistent_hash_spreads_sessions_and_moves_few_when_replicas_change():
    policy, keys = make_policy("consistent_hash"), sessions(2000)
    group = replicas(4)
    before = {key.session: policy.pick(group, key).replica for key in keys}
    shares = Counter(before.values())
    assert len(shares) == 4 and all(400 <= n <= 600 for n in shares.values()), shares

    removed = [r for r in group if r.replica != 2]
    after = {key.session: policy.pick(removed, key).replica for key in keys}
    moved = {s for s in before if before[s] != after[s]}
    # Exactly the sessions of the removed replica move; no other session does.
    assert moved == {s for s, r in before.items() if r == 2}

    grown = [*group, *replicas(5)[4:]]
    after = {key.session: policy.pick(grown, key).replica for key in keys}
    moved = {s for s in before if before[s] != after[s]}
    assert all(after[s] == 4 for s in moved)
    assert 300 <= len(moved) <= 500  # about 1/5 of the sessions


# ---------------------------------------------------------------- load steering


async def simulate(policy_name: str, service_s: dict[str, float], requests: int = 120) -> Counter:
    """Requests arrive every 2 ms; each replica takes its service time to answer."""
    policy = make_policy(policy_name, role="llm", seed=1)
    group = replicas(len(service_s))
    sent: Counter = Counter()

    async def serve(actor_id: str) -> None:
        await asyncio.sleep(service_s[actor_id])
        policy.on_done(actor_id)

    tasks = []
    for i in range(requests):
        chosen = policy.pick(group, PickKey(request_id=f"r{i}")).actor_id
        policy.on_send(chosen)
        sent[chosen] += 1
        tasks.append(asyncio.create_task(serve(chosen)))
        await asyncio.sleep(0.002)
    await asyncio.gather(*tasks)
    return sent


SLOW_REPLICA = {"llm/0": 0.004, "llm/1": 0.080, "llm/2": 0.004}


@pytest.mark.parametrize("name", ["least_outstanding", "power_of_two"])
def test_load_aware_policies_steer_away_from_a_slow_replica(name):
    sent = asyncio.run(simulate(name, SLOW_REPLICA))
    baseline = asyncio.run(simulate("round_robin", SLOW_REPLICA))
    assert baseline["llm/1"] == 40  # round robin ignores the slowness: a third
    assert sent["llm/1"] <= 20, sent  # a load-aware policy sends it a sixth or less


def test_least_outstanding_counts_other_producers_through_heartbeats():
    policy = make_policy("least_outstanding", seed=0)
    group = replicas(3, inflight={0: 4, 1: 0, 2: 6})
    assert {policy.pick(group).replica for _ in range(10)} == {1}
    policy.on_send("llm/1"), policy.on_send("llm/1"), policy.on_send("llm/1")
    policy.on_send("llm/1"), policy.on_send("llm/1")
    assert policy.pick(group).replica == 0  # our own 5 outstanding outweigh its 4
    policy.on_done("llm/1"), policy.on_done("llm/1")
    assert policy.pick(group).replica == 1


# ---------------------------------------------------------------- prefix aware


def test_prefix_aware_picks_the_longest_held_prefix():
    policy = make_policy("prefix_aware", role="llm", seed=0)
    group = replicas(3)
    policy.publish("llm/0", {11, 12})
    policy.publish("llm/1", {11, 12, 13})
    policy.publish("llm/2", {12, 13, 14})  # no leading block: matches nothing
    chain = PickKey("r1", "s", (11, 12, 13, 14))
    assert policy.match_length("llm/2", chain.prefix_hashes) == 0
    assert policy.pick(group, chain).replica == 1
    assert policy.pick(group, chain._replace(prefix_hashes=(11, 99))).replica in (0, 1)


def test_prefix_aware_breaks_ties_by_load_and_falls_back_without_info():
    policy = make_policy("prefix_aware", role="llm", seed=0)
    group = replicas(3)
    # No published prefixes: least outstanding.
    policy.on_send("llm/0"), policy.on_send("llm/2")
    assert policy.pick(group, PickKey("r1", "", (5, 6))).replica == 1

    policy.publish("llm/0", {1, 2})
    policy.publish("llm/2", {1, 2})
    policy.on_send("llm/0")
    assert policy.pick(group, PickKey("r2", "", (1, 2, 3))).replica == 2  # same match, less load
    assert policy.pick(group, PickKey("r3", "", ())).replica == 1  # no chain: least loaded


def test_prefix_aware_passes_over_an_overloaded_match():
    policy = make_policy("prefix_aware", role="llm", seed=0, max_load_gap=2)
    group = replicas(2)
    policy.publish("llm/0", {1, 2, 3, 4})
    for _ in range(3):
        policy.on_send("llm/0")
    assert policy.pick(group, PickKey("r1", "", (1, 2, 3))).replica == 1
    policy.on_done("llm/0")
    assert policy.pick(group, PickKey("r2", "", (1, 2, 3, 4))).replica == 0


def _with_summary(record, summary, started=1.0):
    """A newer registry record of the same replica, as the view decodes one per put."""
    meta = {**record.meta, SUMMARY_META: list(summary)}
    return msgspec.structs.replace(record, meta=meta, started=started)


def test_prefix_aware_reads_summaries_from_the_records_it_is_given():
    policy = make_policy("prefix_aware", role="llm", seed=0)
    group = [_with_summary(r, []) for r in replicas(2)]
    key = PickKey("r1", "chat", prefix_chain("chat"))
    group[1] = _with_summary(group[1], [summary_key("session", "chat")])
    # the other replica is less loaded, but only llm/1 holds the session
    assert all(policy.pick(group, key).replica == 1 for _ in range(5))
    # the replica restarts: its new record (new start time) holds nothing
    group[1] = _with_summary(group[1], [], started=2.0)
    group[0] = _with_summary(group[0], [summary_key("session", "chat")])
    assert policy.pick(group, key).replica == 0


def test_prefix_aware_remembers_its_own_picks_until_the_replica_restarts():
    policy = make_policy("prefix_aware", role="llm", seed=1)
    group = replicas(2)
    key = PickKey("r1", "chat", prefix_chain("chat"))
    home = policy.pick(group, key).replica
    # no summary published yet (the next heartbeat is later): the session still sticks,
    # even when its replica is now the busier one
    policy.on_send(f"llm/{home}")
    assert all(policy.pick(group, key).replica == home for _ in range(5))
    group[home] = msgspec.structs.replace(group[home], started=9.0)  # restarted
    assert policy.pick(group, key).replica == 1 - home  # memory void: least loaded


def test_prefix_aware_spreads_new_sessions_evenly():
    policy = make_policy("prefix_aware", role="llm", seed=3)
    group = replicas(3)
    picks = Counter(
        policy.pick(group, PickKey(f"r{i}", f"s{i}", prefix_chain(f"s{i}"))).replica
        for i in range(9)
    )
    assert picks == {0: 3, 1: 3, 2: 3}


def test_prefix_chain_is_the_session_then_the_media_as_replicas_name_them():
    png, wav = b"\x89PNG fake", b"RIFF fake"
    assert prefix_chain("") == () and prefix_chain("", {"text": "hi"}) == ()
    chain = prefix_chain("s", {"image": png, "audio": wav, "text": "x"})
    assert chain == (
        summary_key("session", "s"),
        summary_key("image", content_hash(png)),
        summary_key("audio", content_hash(wav)),
    )
    # downstream of an encoder the producer has its hashes, not the bytes: same chain
    encoded = {"image_hash": content_hash(png), "audio_spans": [[content_hash(wav), 3]]}
    assert prefix_chain("s", encoded) == chain
    assert prefix_chain("", {"images": [png, wav]}) == (
        summary_key("image", content_hash(png)),
        summary_key("image", content_hash(wav)),
    )
    assert all(0 <= h < 1 << 63 for h in chain)  # fits a signed int64 on any wire
