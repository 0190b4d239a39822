"""An ``llm`` replica killed with -9 mid-stream: the request moves to another replica and
ends whole (no gap, no repeat); with no other replica it fails at once, saying so."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest

import omniflow
from omniflow.roles.llm import LLMRole
from omniflow.runtime.config import parse
from omniflow.runtime.holding import read_holding

PROMPT = {"text": "tell me a long story"}
GREEDY = {"max_tokens": 400, "temperature": 0.0}


@pytest.fixture(scope="module")
def llm_model(tmp_path_factory) -> Path:
    """The tiny LLM built once, before any replica starts (two building one folder race)."""
    path = tmp_path_factory.mktemp("migration-models") / "llm"
    role = LLMRole("llm", 0, {"model_path": str(path), "build_tiny": True})
    role.path = path
    opts = role.options
    role._build_tiny(opts.tiny_preset, opts.hidden_size, opts.seed)
    return path


def llm_config(name: str, model: Path, replicas: int, **runtime):
    return parse(
        {
            "name": name,
            "roles": {
                "llm": {
                    "actor": "omniflow.roles.llm:LLMRole",
                    "replicas": replicas,
                    "max_concurrency": 4,
                    "options": {
                        "model_path": str(model),
                        "kv_cache_mb": 8,
                        "max_tokens": 512,
                        "threads": 1,
                    },
                },
            },
            "graph": {"edges": [{"from": "input", "to": "llm"}]},
            "runtime": {
                "heartbeat_s": 30.0,  # only the holding file says who holds what
                "ttl_s": 60.0,
                "restart_backoff_s": 0.1,
                "start_timeout_s": 120,
                **runtime,
            },
        },
        "<test>",
    )


def holder(rt, request_id: str):
    """The replica whose holding file names ``request_id`` (None while none does)."""
    for r in rt.supervisor.replicas:
        path = Path(rt.run_dir) / f"llm-{r.index}.holding"
        if any(rid == request_id for rid, _ in read_holding(path, r.proc.pid)):
            return r
    return None


async def stream_and_kill(rt, request_id: str, kill_after: int = 1):
    """Stream one request; kill -9 the replica holding it after ``kill_after`` chunks."""
    outputs, result, victim = [], None, None
    async for item in rt.stream(PROMPT, params=GREEDY, request_id=request_id, timeout=60):
        if isinstance(item, omniflow.Result):
            result = item
            continue
        outputs.append(item)
        if len(outputs) == kill_after:
            victim = holder(rt, request_id)
            assert victim is not None
            os.kill(victim.proc.pid, signal.SIGKILL)
    return outputs, result, victim


def test_a_killed_llm_replica_hands_its_stream_to_another(run_root, llm_model):
    async def main():
        async with omniflow.Runtime(llm_config("migrate", llm_model, replicas=2)) as rt:
            ref_outs, ref = await rt.call(PROMPT, params=GREEDY, timeout=60)
            outs, result, victim = await stream_and_kill(rt, "victim-1")
            survivor = {r.actor_id for r in rt.supervisor.replicas} - {victim.actor_id}
            return ref_outs, ref, outs, result, victim.actor_id, survivor

    ref_outs, ref, outs, result, victim, survivor = asyncio.run(main())
    ref_tokens = [t for o in ref_outs for t in o.data["tokens"]]
    assert len(ref_tokens) > 100, "the reference must be long enough to be cut"
    assert result is not None and result.migrations == 1
    assert result.request_id == "victim-1"
    # Every chunk once, numbered on from where the dead replica stopped.
    assert [o.seq for o in outs] == list(range(len(outs)))
    assert [t for o in outs for t in o.data["tokens"]] == ref_tokens  # greedy: the same
    assert "".join(o.data["text"] for o in outs) == "".join(o.data["text"] for o in ref_outs)
    assert outs[-1].data.get("finished") is True
    # The rest ran on the survivor, after it re-prefilled the prompt and what was sent.
    last = [t for t in result.timings if t.role == "llm"]
    assert {f"llm/{t.replica}" for t in last} == survivor != {victim}
    assert result.usage["completion_tokens"] == len(ref_tokens)


def test_a_seeded_request_that_migrates_samples_what_it_would_have(run_root, llm_model):
    """Sampled, not greedy: the replica that goes on draws each token from (seed, position),
    so the output equals that of a run with no kill."""
    seeded = {"max_tokens": 300, "temperature": 1.0, "top_k": 40, "seed": 1234}

    async def main():
        async with omniflow.Runtime(llm_config("migrateseed", llm_model, replicas=2)) as rt:
            ref_outs, _ = await rt.call(PROMPT, params=seeded, timeout=60)
            outs, result = [], None
            async for item in rt.stream(PROMPT, params=seeded, request_id="seeded-1", timeout=60):
                if isinstance(item, omniflow.Result):
                    result = item
                    continue
                outs.append(item)
                if len(outs) == 2:
                    victim = holder(rt, "seeded-1")
                    assert victim is not None
                    os.kill(victim.proc.pid, signal.SIGKILL)
            return ref_outs, outs, result

    ref_outs, outs, result = asyncio.run(main())
    ref_tokens = [t for o in ref_outs for t in o.data["tokens"]]
    assert len(ref_tokens) > 50, "the reference must be long enough to be cut"
    assert result is not None and result.migrations == 1
    assert [o.seq for o in outs] == list(range(len(outs)))
    assert [t for o in outs for t in o.data["tokens"]] == ref_tokens


def test_a_killed_llm_with_no_other_replica_fails_at_once(run_root, llm_model):
    async def main():
        async with omniflow.Runtime(llm_config("nomigrate", llm_model, replicas=1)) as rt:
            started = time.monotonic()
            try:
                await stream_and_kill(rt, "alone-1")
            except omniflow.RequestFailed as e:
                return e, time.monotonic() - started
            raise AssertionError("the request survived its only replica's death")

    failure, waited = asyncio.run(main())
    assert (failure.code, failure.role, failure.request_id) == ("unavailable", "llm", "alone-1")
    assert "no other replica of 'llm'" in failure.detail
    assert waited < 30.0  # not the 60 s deadline


def test_migration_off_fails_as_before(run_root, llm_model):
    cfg = llm_config("migrateoff", llm_model, replicas=2, max_migrations=0)

    async def main():
        async with omniflow.Runtime(cfg) as rt:
            try:
                await stream_and_kill(rt, "off-1")
            except omniflow.RequestFailed as e:
                return e
            raise AssertionError("migrated with max_migrations = 0")

    failure = asyncio.run(main())
    assert (failure.code, failure.role) == ("unavailable", "llm")


def test_resume_tokens_are_checked(run_root, llm_model):
    async def main():
        async with omniflow.Runtime(llm_config("resumebad", llm_model, replicas=1)) as rt:
            bad = {**GREEDY, "resume": {"tokens": [1, "x"]}}
            with pytest.raises(omniflow.RequestFailed) as bad_type:
                await rt.call(PROMPT, params=bad, timeout=60)
            huge = {**GREEDY, "resume": {"tokens": [10**9]}}
            with pytest.raises(omniflow.RequestFailed) as out_of_range:
                await rt.call(PROMPT, params=huge, timeout=60)
            outs, _ = await rt.call(PROMPT, params=GREEDY, timeout=60)  # still serving
            return bad_type.value, out_of_range.value, outs

    bad_type, out_of_range, outs = asyncio.run(main())
    for failure in (bad_type, out_of_range):
        assert failure.code == "bad_request"
        assert "params.resume.tokens" in failure.detail
    assert outs


def test_a_first_hop_to_a_dead_llm_replica_moves_on(run_root, llm_model):
    """The client's view still lists a replica that died (its record kept, as while a
    lease runs out): a request sent there that it did not take goes to the other one."""
    cfg = llm_config("deadhop", llm_model, replicas=2, send_timeout_s=0.3, restart_backoff_s=30.0)

    async def main():
        async with omniflow.Runtime(cfg) as rt:
            rt.supervisor.forget_dead = False
            victim = next(r for r in rt.supervisor.replicas if r.index == 1)
            os.kill(victim.proc.pid, signal.SIGKILL)
            await asyncio.sleep(0.3)
            assert rt.client.view.find("llm/1") is not None  # still listed
            params = {**GREEDY, "max_tokens": 4}
            return [await rt.call(PROMPT, params=params, timeout=30) for _ in range(4)]

    ends = asyncio.run(main())
    moved = [result.migrations for _, result in ends]
    assert all(outs for outs, _ in ends)
    assert 1 in moved and set(moved) <= {0, 1}  # round robin: some were sent to llm/1
    assert {t.replica for _, result in ends for t in result.timings} == {0}
