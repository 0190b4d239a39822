"""A dead engine is a dead worker: an exception in the engine thread's step() ends the llm
worker process, the request it held fails ``unavailable`` at once (no other replica to
migrate to), the replica leaves the registry (what /health reads) and `status`'s state file
shows it restarting, and the supervisor's restart serves again.

The failure is injected in a real deployment with OMNIFLOW_FAIL_ENGINE_AFTER_STEPS (read by
AsyncEngine, omniflow/engine/async_engine.py): the engine thread raises in that step, as a
forward that fails would.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

import omniflow
from omniflow.engine.async_engine import FAIL_AFTER_STEPS_ENV
from omniflow.roles.base import ENGINE_DEAD_EXIT
from omniflow.roles.llm import LLMRole
from omniflow.runtime.config import parse

PROMPT = {"text": "tell me a long story"}
FAIL_AT = 40  # engine steps, in each process: one long request reaches it, a short one not


@pytest.fixture(scope="module")
def llm_model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("engine-death-models") / "llm"
    role = LLMRole("llm", 0, {"model_path": str(path), "build_tiny": True})
    role.path = path
    opts = role.options
    role._build_tiny(opts.tiny_preset, opts.hidden_size, opts.seed)
    return path


def config(model: Path):
    return parse(
        {
            "name": "enginedeath",
            "roles": {
                "llm": {
                    "actor": "omniflow.roles.llm:LLMRole",
                    "replicas": 1,
                    "options": {
                        "model_path": str(model),
                        "kv_cache_mb": 8,
                        "max_tokens": 512,
                        "threads": 1,
                    },
                },
            },
            "graph": {"edges": [{"from": "input", "to": "llm"}]},
            "runtime": {"restart_backoff_s": 0.1, "start_timeout_s": 120},
        },
        "<test>",
    )


async def until(predicate, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def call_until_taken(rt, attempts: int = 20):
    """A short request to the restarted replica: the first sends may race the client's
    connection to the new process ("did not take the request"); a few tries, then it serves."""
    for attempt in range(attempts):
        try:
            return await rt.call(PROMPT, params={"max_tokens": 4, "temperature": 0.0}, timeout=60)
        except omniflow.RequestFailed as e:
            if e.code != "unavailable" or attempt == attempts - 1:
                raise
            await asyncio.sleep(0.5)
    raise AssertionError("unreachable")


def test_an_engine_that_raises_in_step_ends_its_worker(run_root, llm_model, monkeypatch):
    monkeypatch.setenv(FAIL_AFTER_STEPS_ENV, str(FAIL_AT))

    async def main():
        async with omniflow.Runtime(config(llm_model)) as rt:
            replica = rt.supervisor.replicas[0]
            first_pid, exited = replica.proc.pid, replica.exited
            view = rt.client.view
            assert view.replicas("llm")
            started = time.monotonic()
            with pytest.raises(omniflow.RequestFailed) as failed:
                await rt.call(PROMPT, params={"max_tokens": 400, "temperature": 0.0}, timeout=60)
            waited = time.monotonic() - started
            code = await asyncio.wait_for(asyncio.shield(exited), 30)
            # Not serving: the state file (what `omniflow status` reads) says restarting, and
            # the record is out of the registry (what the gateway's /health reads).
            states = [
                a["state"] for a in json.loads(rt.supervisor.state_path.read_text())["actors"]
            ]
            await until(lambda: not view.replicas("llm"), 10)
            # The restart serves again (a short request stays under FAIL_AT steps).
            await until(lambda: replica.state == "ready" and replica.proc.pid != first_pid, 120)
            await until(lambda: bool(view.replicas("llm")))
            outputs, result = await call_until_taken(rt)
            return failed.value, waited, code, states, replica.restarts, outputs, result

    failure, waited, code, states, restarts, outputs, result = asyncio.run(main())
    assert (failure.code, failure.role) == ("unavailable", "llm")
    assert waited < 30.0  # told at once, not at the 60 s deadline
    assert code == ENGINE_DEAD_EXIT
    assert states == ["restarting"]
    assert restarts == 1
    assert sum(len(o.data["tokens"]) for o in outputs) == 4
    assert result is not None
