"""Model threads run below their event loop's priority, so the loop moves requests first
when the CPU is short (omniflow/runtime/priority.py). Real threads, read back from the kernel."""

from __future__ import annotations

import asyncio
import functools
import re
import sys

import pytest

from omniflow.engine import AsyncEngine, LLMEngine
from omniflow.engine.llm_engine import EngineConfig
from omniflow.models import build_tiny_model
from omniflow.roles.base import ModelActor
from omniflow.runtime.priority import DEFAULT_MODEL_NICE, lower_thread_priority, thread_nice
from omniflow.runtime.tables import FieldError

linux_only = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="a nice value per thread is Linux's"
)


async def loop_and_model_nice(actor: ModelActor) -> tuple[int, int]:
    try:
        return thread_nice(), await actor._run(thread_nice)
    finally:
        await actor.close()


@linux_only
@pytest.mark.parametrize(
    "options, step", [({}, DEFAULT_MODEL_NICE), ({"model_nice": 3}, 3), ({"model_nice": 0}, 0)]
)
def test_model_thread_runs_model_nice_levels_below_the_loop(options, step):
    loop, model = asyncio.run(loop_and_model_nice(ModelActor("vision_encoder", 0, options)))
    assert model == min(19, loop + step)
    assert thread_nice() == loop  # the loop's own thread is left as it was


@pytest.mark.parametrize(
    "value, message",
    [
        (-1, "model_nice = -1: expected int >= 0"),
        (20, "model_nice = 20: expected int <= 19"),
        ("high", 'model_nice = "high": expected int, got str'),
        (None, "model_nice = null: expected int, got null"),
    ],
)
def test_a_bad_model_nice_names_the_role_and_option(value, message):
    with pytest.raises(FieldError, match=re.escape(f"[roles.image_decoder.options] {message}")):
        ModelActor("image_decoder", 0, {"model_nice": value})


@linux_only
def test_engine_thread_runs_its_setup_first(tmp_path):
    folder = build_tiny_model(tmp_path / "llm", "llama-mha")

    async def main() -> tuple[int, int]:
        engine = AsyncEngine(
            LLMEngine(folder, EngineConfig(device="cpu")),
            thread_setup=functools.partial(lower_thread_priority, 4),
        )
        try:
            return thread_nice(), await engine.call(thread_nice)
        finally:
            await engine.close()

    loop, engine_thread = asyncio.run(main())
    assert engine_thread == min(19, loop + 4)
