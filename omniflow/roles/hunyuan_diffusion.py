"""``diffusion`` role of the HunyuanImage-3 pipeline: the denoising loop on the backbone.

Input (from ar):
    kv_lease, kv_lease_uncond: dict     read-only leases on the cond and uncond context KV
    grid: [h, w]; context_len: int; size: [width, height]
    params: seed, steps, cfg_scale (checked again here)
Output:
    {"progress": {"step": k, "steps": n}}        one per step, to the client
    {"latent": float32 [C, h*p, w*p], "size": [width, height]}     to vae_decoder

The context KV is borrowed, never recomputed: the engine keeps a context over the two
leases, and each denoising step is one block step (the <timestep> row and the image rows,
bidirectional among themselves, causal to the context) with the unconditional half paired
in the same forward. Flow matching: shifted sigmas, Euler steps, noise from the seed (same
seed, same latent, same PNG). ``stats`` (published in the registry record, and per request
in the usage) counts the rows this role's engine forwarded and how many were prompt rows:
zero. The weights are the ones ``ar`` mapped: one copy in the host pool.

Options: ``HunyuanDiffusionOptions`` in roles/options.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch

from omniflow.cache.kv_share import KVLeaseView
from omniflow.engine import EngineConfig, Guidance, LLMEngine
from omniflow.engine.denoise import denoise
from omniflow.roles.base import ModelActor
from omniflow.roles.hunyuan_backbone import Backbone
from omniflow.roles.image_params import ImageParams, image_params
from omniflow.roles.options import HunyuanDiffusionOptions
from omniflow.runtime.actor import BadRequest, Context, MemoryBudget, Request

Progress = Callable[[int, int], None]


class DiffusionRole(ModelActor):
    Options = HunyuanDiffusionOptions
    options: HunyuanDiffusionOptions

    async def setup(self) -> None:
        if self.pool is None:
            raise RuntimeError("the diffusion role borrows KV from the host page pool: none given")
        self.start_model_thread()
        self.backbone = await self._run(Backbone.load, self.options, self.pool)
        self.config = self.backbone.config
        self.engine = await self._run(self._engine, self.options.kv_cache_mb << 20)
        self.weights = self.backbone.where()  # as the engine runs them
        self._ids = itertools.count()
        self.stats = {"rows_forwarded": 0, "prompt_rows_forwarded": 0, "requests": 0}

    def _engine(self, kv_bytes: int) -> LLMEngine:
        config = EngineConfig(
            device=self.options.device,
            kv_cache_bytes=kv_bytes,
            # Shared weights stay in the pages ar maps too (no private re-layout).
            relayout_weights=self.backbone.weights is None,
        )
        return LLMEngine(self.backbone.model, config, self.backbone.tokenizer, self.pool)

    async def reserve(self, budget: MemoryBudget) -> None:
        """Co-located with ar: the KV of the image rows takes at most this role's share."""
        if budget.bytes < self.options.kv_cache_mb << 20:
            self.engine = await self._run(self._engine, max(budget.bytes, 1 << 20))

    async def close(self) -> None:
        await super().close()
        self.backbone.close()

    def meta(self) -> dict[str, Any]:
        weights = getattr(self, "weights", None)
        return {} if weights is None else {"weights": weights, "stats": dict(self.stats)}

    async def handle(self, request: Request, ctx: Context):
        try:
            params, grid, inputs = self._checked(request)
        except BadRequest:
            self._give_back(request.data)
            raise
        loop = asyncio.get_running_loop()
        steps: asyncio.Queue = asyncio.Queue()
        stop = threading.Event()

        def progress(step: int, total: int) -> None:
            loop.call_soon_threadsafe(steps.put_nowait, (step, total))

        rid = f"{request.request_id}-{next(self._ids)}"
        job = asyncio.ensure_future(
            self._run(self._denoise, rid, inputs, tuple(grid), params, progress, stop)
        )
        job.add_done_callback(lambda _: loop.call_soon(steps.put_nowait, None))
        job.add_done_callback(_retrieved)  # a cancelled request's stop error is expected
        try:
            while (item := await steps.get()) is not None:
                yield {"progress": {"step": item[0], "steps": item[1]}}
            latent, rows, prompt_rows = await job
        finally:
            stop.set()  # cancelled: the loop stops at the next step and lets the leases go
        self.stats["rows_forwarded"] += rows
        self.stats["prompt_rows_forwarded"] += prompt_rows
        self.stats["requests"] += 1
        ctx.add_usage(diffusion_rows_forwarded=rows, diffusion_prompt_rows_forwarded=prompt_rows)
        per = self.config.pixels_per_token
        yield {"latent": latent, "size": [grid[1] * per, grid[0] * per]}

    def _checked(self, request: Request) -> tuple[ImageParams, list[int], tuple[Any, ...]]:
        opts = self.options
        params = image_params(
            request.params,
            steps=opts.steps,
            max_steps=opts.max_steps,
            cfg_scale=opts.cfg_scale,
            pixels_per_token=self.config.pixels_per_token,
            max_tokens=1 << 30,  # ar checked the size; the grid is checked below
        )
        grid = request.data.get("grid")
        if not (
            isinstance(grid, list)
            and len(grid) == 2
            and all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in grid)
        ):
            raise BadRequest("grid", f"expected [h, w] of positive integers, got {grid!r}")
        inputs = tuple(request.data.get(k) for k in ("kv_lease", "kv_lease_uncond"))
        inputs += tuple(request.data.get(k) for k in ("context_ids", "uncond_ids"))
        if not all(isinstance(lease, dict) for lease in inputs[:2]) or not all(
            isinstance(ids, list) for ids in inputs[2:]
        ):
            raise BadRequest("kv_lease", "expected the cond and uncond KV leases and their ids")
        return params, grid, inputs

    def discard(self, data: Mapping[str, Any]) -> None:
        """A request that never reached handle (expired or cancelled in the queue)."""
        self._give_back(data)

    def _give_back(self, data: Mapping[str, Any]) -> None:
        """A refused request's leases, dropped at once: the lender unlocks its pages."""
        if self.pool is None:
            return
        for key in ("kv_lease", "kv_lease_uncond"):
            with contextlib.suppress(Exception):  # not a lease: nothing to give back
                KVLeaseView(self.pool, data[key]).close()

    def _denoise(
        self,
        rid: str,
        inputs: tuple[Any, ...],
        grid: tuple[int, int],
        params: ImageParams,
        progress: Progress,
        stop: threading.Event,
    ) -> tuple[torch.Tensor, int, int]:
        """On the model thread: the whole loop over the borrowed context. Returns the latent,
        the rows forwarded and how many of those were the context's (prompt) rows."""
        engine = self.engine
        lease, uncond_lease, ids, uncond_ids = inputs
        before = dict(engine.stats)
        context = f"{rid}-ctx"
        # The engine reads the lent pages in place; release() hands the leases back.
        guidance = Guidance(uncond_ids, params.cfg_scale, lease=uncond_lease, combine=False)
        engine.keep_context(context, ids, guidance=guidance, lease=lease)

        def report(step: int, steps: int) -> None:
            if stop.is_set():  # the request was cancelled: stop here, let the leases go
                raise RuntimeError(f"request {rid}: cancelled after step {step}")
            progress(step, steps)

        try:
            latent = denoise(
                engine,
                self.backbone.parts,
                context,
                len(ids),
                grid,
                params.steps,
                params.cfg_scale,
                params.seed,
                report,
                self.options.shift,
            )
        finally:
            engine.release(context)
        rows = engine.stats["rows_forwarded"] - before["rows_forwarded"]
        prompt_rows = engine.stats["prompt_tokens_computed"] - before["prompt_tokens_computed"]
        return latent.float().contiguous(), rows, prompt_rows


def _retrieved(job: asyncio.Future) -> None:
    if not job.cancelled():
        job.exception()
