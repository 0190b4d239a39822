"""An asyncio face for an EngineBackend: model steps run on a dedicated thread, so the
event loop of the actor hosting the engine never waits on compute.

    engine = AsyncEngine.from_path(model_path)
    async for delta in engine.generate("req-1", prompt_ids, SamplingParams(max_tokens=32)):
        ...  # TokenDelta per step; the last one has finish_reason set
    await engine.close()

Leaving the `async for` early (break, cancellation) aborts the request.
"""

from __future__ import annotations

import asyncio
import os
import queue
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any, NamedTuple

import torch

from omniflow.engine.figures import engine_description
from omniflow.engine.llm_engine import EngineConfig, LLMEngine
from omniflow.engine.protocol import EngineBackend, TokenDelta
from omniflow.engine.sampling_params import SamplingParams
from omniflow.engine.sequence import EmbeddingSpan


class EngineDeadError(RuntimeError):
    """The engine thread stopped on an error; every open and later request gets this."""


# Test-only fault injection: with this set to N, the engine thread raises in its N-th step, as
# a forward that fails (a CUDA out-of-memory, a kernel error) would. tests/roles/
# test_engine_death.py sets it for a real deployment; nothing else reads it.
FAIL_AFTER_STEPS_ENV = "OMNIFLOW_FAIL_ENGINE_AFTER_STEPS"


class _Add(NamedTuple):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams | None
    embeddings: list[EmbeddingSpan] | None
    options: dict[str, Any]  # add_request's keywords beyond these (lend_kv_to, head, ...)


class _BlockStep(NamedTuple):
    request_id: str
    context_id: str
    rows: torch.Tensor
    positions: torch.Tensor
    causal_rows: int = 0


class _Release(NamedTuple):
    request_id: str


class _Abort(NamedTuple):
    request_id: str


class _Call(NamedTuple):
    function: Callable[[], Any]
    future: Future


_STOP = object()


class AsyncEngine:
    def __init__(
        self,
        backend: EngineBackend,
        thread_setup: Callable[[], None] | None = None,
        on_death: Callable[[BaseException], None] | None = None,
    ):
        """thread_setup: called on the engine thread before anything else (a role lowers the
        thread's priority with it, see omniflow/runtime/priority.py). on_death: called on the
        engine thread with the error that stopped it, before the open requests hear of it (a
        role exits its worker there: a dead engine is a dead worker, and the supervisor
        restarts it, see ModelActor.engine_died)."""
        self.backend = backend
        self._thread_setup = thread_setup
        self._on_death = on_death
        self._fail_after_steps = int(os.environ.get(FAIL_AFTER_STEPS_ENV) or 0)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._streams_lock = threading.Lock()
        self._dead: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="omniflow-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_path(cls, model_path: str | Path, config: EngineConfig | None = None) -> AsyncEngine:
        return cls(LLMEngine(model_path, config))

    @property
    def stats(self) -> dict[str, int]:
        """The backend's counters; read them on the engine thread (in `call`) for a value
        that no step is changing."""
        return self.backend.stats

    def lends_kv(self) -> bool:
        """Whether KV this engine lent is still held by a borrower (a step reaps the
        leases they let go)."""
        book = self.backend.leases
        return book is not None and bool(book.open)

    def description(self) -> dict[str, Any]:
        """What the backend loaded (dtype, device, KV pages, kernels), for logs."""
        return engine_description(self.backend)

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        embeddings: list[EmbeddingSpan] | None = None,
        lend_kv_to: int | None = None,
        **options: Any,
    ) -> AsyncIterator[TokenDelta]:
        """Yield this request's TokenDeltas as steps produce them; raises ValueError for a bad
        request, EngineDeadError if the engine thread died. options: the backend's further
        add_request keywords (head, guidance, keep, continue_from)."""
        if lend_kv_to is not None:
            options["lend_kv_to"] = lend_kv_to
        command = _Add(request_id, list(prompt_token_ids), params, embeddings, options)
        async for delta in self._stream(request_id, command):
            yield delta

    async def block_step(
        self,
        request_id: str,
        context_id: str,
        rows: torch.Tensor,
        positions: torch.Tensor,
        causal_rows: int = 0,
    ) -> TokenDelta:
        """One block step over the kept request context_id (LLMEngine.block_step): its delta,
        whose ``hidden`` holds the rows' final hidden states."""
        async for delta in self._stream(
            request_id, _BlockStep(request_id, context_id, rows, positions, causal_rows)
        ):
            last = delta
        return last

    async def keep_context(
        self,
        context_id: str,
        prompt_token_ids: Sequence[int],
        embeddings: list[EmbeddingSpan] | None = None,
        guidance: Any = None,
        lease: Any = None,
    ) -> None:
        """Hold a prompt as a kept context for block steps (LLMEngine.keep_context; lease:
        the prompt's K/V lent by another process)."""
        tokens = list(prompt_token_ids)
        await self.call(
            lambda: self.backend.keep_context(context_id, tokens, embeddings, guidance, lease)
        )

    def release(self, request_id: str) -> None:
        """Free a kept request's pages (LLMEngine.release)."""
        self._commands.put(_Release(request_id))

    async def _stream(self, request_id: str, command: Any) -> AsyncIterator[TokenDelta]:
        if self._dead is not None:
            raise EngineDeadError("engine thread is not running") from self._dead
        stream: asyncio.Queue = asyncio.Queue()
        with self._streams_lock:
            if request_id in self._streams:
                raise ValueError(f"request {request_id}: request_id is already in use")
            self._streams[request_id] = (asyncio.get_running_loop(), stream)
        self._commands.put(command)
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finish_reason is not None
                yield item
                if finished:
                    return
        finally:
            with self._streams_lock:
                self._streams.pop(request_id, None)
            if not finished:
                self._commands.put(_Abort(request_id))

    def abort(self, request_id: str) -> None:
        """Stop a request; its stream ends with a finish_reason "abort" delta."""
        self._commands.put(_Abort(request_id))

    async def call(self, function: Callable[[], Any]) -> Any:
        """Run ``function()`` on the engine thread between steps (to read engine state, such as
        the prefix cache's block hashes, without racing the steps that change it)."""
        future: Future = Future()
        self._commands.put(_Call(function, future))
        return await asyncio.wrap_future(future)

    async def close(self) -> None:
        self._commands.put(_STOP)
        await asyncio.to_thread(self._thread.join)
        close = getattr(self.backend, "close", None)
        if close is not None:
            close()

    def _deliver(self, request_id: str, item: TokenDelta | BaseException) -> None:
        with self._streams_lock:
            target = self._streams.get(request_id)
        if target is not None:
            loop, stream = target
            try:
                loop.call_soon_threadsafe(stream.put_nowait, item)
            except RuntimeError:
                pass  # that loop is closed: nobody is listening any more

    def _apply(self, command) -> bool:
        if command is _STOP:
            return False
        if isinstance(command, _Add | _BlockStep):
            try:
                if isinstance(command, _Add):
                    self.backend.add_request(
                        command.request_id,
                        command.prompt_token_ids,
                        command.params,
                        command.embeddings,
                        **command.options,
                    )
                else:
                    self.backend.block_step(*command)
            except (ValueError, NotImplementedError) as error:
                self._deliver(command.request_id, error)
        elif isinstance(command, _Release):
            self.backend.release(command.request_id)
        elif isinstance(command, _Abort):
            self.backend.abort(command.request_id)
        elif isinstance(command, _Call) and command.future.set_running_or_notify_cancel():
            try:
                command.future.set_result(command.function())
            except Exception as error:  # noqa: BLE001 - it belongs to the caller
                command.future.set_exception(error)
        return True

    def _inject_failure(self) -> None:
        if self._fail_after_steps:
            self._fail_after_steps -= 1
            if not self._fail_after_steps:
                raise RuntimeError(f"injected engine failure ({FAIL_AFTER_STEPS_ENV})")

    def _run(self) -> None:
        if self._thread_setup is not None:
            self._thread_setup()
        try:
            with torch.inference_mode():
                while True:
                    # Block when idle, drain when busy.
                    if not self.backend.has_unfinished_requests():
                        if not self._apply(self._commands.get()):
                            return
                    while not self._commands.empty():
                        if not self._apply(self._commands.get_nowait()):
                            return
                    self._inject_failure()
                    for delta in self.backend.step():
                        self._deliver(delta.request_id, delta)
        except BaseException as error:  # noqa: BLE001 - every waiter must hear about it
            self._dead = error
            if self._on_death is not None:
                self._on_death(error)
            with self._streams_lock:
                request_ids = list(self._streams)
            for request_id in request_ids:
                dead = EngineDeadError(f"engine thread died: {error!r}")
                dead.__cause__ = error
                self._deliver(request_id, dead)
