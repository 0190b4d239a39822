"""What every model-serving role shares: one model thread off the event loop."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar, TypeVar

import torch

from omniflow.engine.figures import engine_figures
from omniflow.memory import CacheConfig, PagePool
from omniflow.roles.options import ModelThreadOptions
from omniflow.runtime.actor import Actor
from omniflow.runtime.priority import lower_thread_priority

T = TypeVar("T")

log = logging.getLogger(__name__)

# A worker whose engine thread died exits with this (EX_SOFTWARE); the supervisor restarts it.
ENGINE_DEAD_EXIT = 70


class ModelActor(Actor):
    """A role whose model runs on one dedicated thread, so the actor keeps serving.

    Requests reach the model one at a time, in arrival order. The ``threads``
    option sets torch's intra-op threads for the process (each replica is its own
    process, so this is per replica). The model thread runs ``model_nice`` (default 10,
    0 turns it off) nice levels below the event loop, so the loop moves requests first
    when the CPU is short (see omniflow/runtime/priority.py).

    ``figures()`` (the replica's /metrics figures) counts the model thread's calls: how
    many run and wait for it now, and their count and compute seconds since the replica
    started (its load and warm-up included). Each counter has one writer (the event loop
    or the model thread), so reading them at a heartbeat needs no lock.
    """

    Options: ClassVar[type[ModelThreadOptions]] = ModelThreadOptions
    options: ModelThreadOptions

    _executor: ThreadPoolExecutor | None = None
    pool: PagePool | None = None  # the deployment's page pool, given by the worker
    cache_config: CacheConfig | None = None
    # The model thread's figures: calls given (event loop), returned (event loop: done or
    # cancelled), started and finished (model thread), compute seconds (model thread).
    _given = _returned = _started = _finished = 0
    _compute_s = 0.0

    def use_pool(self, pool: PagePool, config: CacheConfig) -> None:
        """Called by the worker before ``setup()``: the page pool every local process maps."""
        self.pool = pool
        self.cache_config = config

    def start_model_thread(self, name: str = "") -> None:
        if self.options.threads is not None:
            torch.set_num_threads(self.options.threads)
        label = name or f"{self.role}-{self.replica}"
        self._executor = ThreadPoolExecutor(
            1,
            thread_name_prefix=label,
            initializer=lower_thread_priority,
            initargs=(self.model_nice,),
        )

    @property
    def model_nice(self) -> int:
        return self.options.model_nice

    def describe(self) -> dict[str, Any]:
        """The model folder, device and threads: the start-up log line's minimum."""
        options = self.options
        described: dict[str, Any] = {"threads": torch.get_num_threads()}
        for key in ("model_path", "device", "dtype"):
            value = getattr(options, key, None)
            if value:
                described["model" if key == "model_path" else key] = str(value)
        return described

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        if self._executor is None:
            self.start_model_thread()
        loop = asyncio.get_running_loop()
        self._given += 1
        try:
            return await loop.run_in_executor(self._executor, self._timed, fn, args)
        finally:
            self._returned += 1

    def _timed(self, fn: Callable[..., T], args: tuple[Any, ...]) -> T:
        """On the model thread: ``fn(*args)``, counted and timed."""
        self._started += 1
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self._compute_s += time.perf_counter() - start
            self._finished += 1

    def figures(self) -> dict[str, float]:
        """The model thread's figures, and an LLM engine's (KV pages, queues, steps)
        where the role runs one (``self.engine``, an AsyncEngine over an LLMEngine)."""
        running = self._started - self._finished
        figures = {
            "model_running": float(running),
            "model_waiting": float(max(self._given - self._returned - running, 0)),
            "compute_seconds_count": float(self._finished),
            "compute_seconds_sum": self._compute_s,
        }
        backend = getattr(getattr(self, "engine", None), "backend", None)
        if backend is not None and hasattr(backend, "allocator"):
            figures.update(engine_figures(backend))
        return figures

    def engine_died(self, error: BaseException) -> None:
        """An AsyncEngine's on_death: a dead engine is a dead worker. The process exits at
        once, before any request hears of the error, so the supervisor's death notices fail
        (or migrate) what it held, exactly as after a kill, deletes its registry record (so
        /health and `omniflow status` show the replica not serving) and restarts it."""
        text = "".join(traceback.format_exception(error))
        log.critical(
            "%s/%d: engine thread died; exiting the worker\n%s", self.role, self.replica, text
        )
        for handler in logging.getLogger().handlers:
            handler.flush()
        sys.stderr.flush()
        os._exit(ENGINE_DEAD_EXIT)

    async def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None
