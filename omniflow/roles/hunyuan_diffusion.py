"""``diffusion`` role of the HunyuanImage-3 pipeline: the denoising loop on the backbone.

Input (from ar):
    kv_lease, kv_lease_uncond: dict     read-only leases on the cond and uncond context KV
    context_ids, uncond_ids: list[int]  the tokens they hold
    grid: [h, w]; size: [width, height]
    params: seed, steps, cfg_scale (checked again here)
Output:
    {"progress": {"step": k, "steps": n}}        one per step, to the client
    {"latent": float32 [C, h*p, w*p], "size": [width, height]}     to vae_decoder

The context KV is borrowed, never recomputed (with ``reuse_prefix = false`` this role instead
computes it from ``context_ids``/``uncond_ids`` and a condition image's rows, as a separate
stage does: for ar on another host, and the baseline of benchmarks/diffusion.py): the engine keeps a context over the two
leases, and each denoising step is one block step (the <timestep> row and the image rows,
bidirectional among themselves, causal to the context) with the unconditional half paired
in the same forward; concurrent requests' steps batch in the engine's steps. Flow matching: shifted sigmas, Euler steps, noise from the seed (same
seed, same latent, same PNG). ``stats`` (published in the registry record, and per request
in the usage: what the engine forwarded while the request ran) counts the rows forwarded
and how many were prompt rows: zero. The weights are the ones ``ar`` mapped: one copy in the host pool.

Options: ``HunyuanDiffusionOptions`` in roles/options.py.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import AsyncGenerator, Mapping
from typing import Any

import torch

from omniflow.engine import AsyncEngine, EngineConfig, Guidance, LLMEngine
from omniflow.kv.share import KVLeaseView
from omniflow.models.hunyuan_image3.config import generation_defaults
from omniflow.models.hunyuan_image3.denoise import Denoising, denoise_steps
from omniflow.roles.base import ModelActor
from omniflow.roles.hunyuan_backbone import Backbone, spans_of
from omniflow.roles.image_params import ImageParams, image_params
from omniflow.roles.options import HunyuanDiffusionOptions, TextToImageParams
from omniflow.runtime.actor import BadRequest, Context, MemoryBudget, Request
from omniflow.runtime.priority import lower_thread_priority


class DiffusionRole(ModelActor):
    Options = HunyuanDiffusionOptions
    Params = TextToImageParams
    options: HunyuanDiffusionOptions

    async def setup(self) -> None:
        if self.pool is None and self.options.reuse_prefix:
            raise RuntimeError(
                "the diffusion role borrows KV from the host page pool: none given "
                "(reuse_prefix = false computes it here instead)"
            )
        self.start_model_thread()
        self.backbone = await self._run(Backbone.load, self.options, self.pool, self.role)
        self.config = self.backbone.config
        given = self.options
        folder = generation_defaults(given.model_path)  # the request's values win over both
        self.steps = folder.steps if given.steps is None else given.steps
        self.cfg_scale = folder.guidance_scale if given.cfg_scale is None else given.cfg_scale
        self.shift = folder.flow_shift if given.shift is None else given.shift
        self.engine = self._engine(self.options.kv_cache_mb << 20)
        self.weights = self.backbone.where()  # as the engine runs them
        self._ids = itertools.count()
        self.stats = {"rows_forwarded": 0, "prompt_rows_forwarded": 0, "requests": 0}

    def _engine(self, kv_bytes: int) -> AsyncEngine:
        config = EngineConfig(
            device=self.options.device,
            kv_cache_bytes=kv_bytes,
            # Shared weights stay in the pages ar maps too (no private re-layout).
            relayout_weights=self.backbone.weights is None,
            enable_prefix_caching=self.options.reuse_prefix,
        )
        engine = LLMEngine(self.backbone.model, config, self.backbone.tokenizer, self.pool)
        return AsyncEngine(
            engine,
            thread_setup=functools.partial(lower_thread_priority, self.model_nice),
            on_death=self.engine_died,
        )

    async def reserve(self, budget: MemoryBudget) -> None:
        """Co-located with ar: the KV of the image rows takes at most this role's share."""
        if budget.bytes < self.options.kv_cache_mb << 20:
            await self.engine.close()
            self.engine = self._engine(max(budget.bytes, 1 << 20))

    async def close(self) -> None:
        await self.engine.close()  # hands back the leases of contexts still kept
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
        rid = f"{request.request_id}-{next(self._ids)}"
        latent, before = None, 0
        mine = [0]  # rows this request's block steps forwarded (cond and uncond halves)
        # aclosing: a cancelled request's loop ends at once, handing the leases back.
        async with contextlib.aclosing(
            self._denoise(rid, inputs, (grid[0], grid[1]), params, mine)
        ) as run:
            async for step in run:
                if isinstance(step, torch.Tensor):
                    latent = step
                elif step == 0:  # the context is kept: the counts start here
                    before = await self.engine.call(self._prompt_rows)
                else:
                    yield {"progress": {"step": step, "steps": params.steps}}
        assert latent is not None
        after = await self.engine.call(self._prompt_rows)
        # The engine's count over this request's life (concurrent requests' too): a prompt
        # row forwarded by anyone meanwhile shows, so 0 proves none was.
        prompt_rows = after - before
        self.stats["rows_forwarded"] += mine[0]
        self.stats["prompt_rows_forwarded"] += prompt_rows
        self.stats["requests"] += 1
        ctx.add_usage(diffusion_rows_forwarded=mine[0], diffusion_prompt_rows_forwarded=prompt_rows)
        per = self.config.pixels_per_token
        yield {"latent": latent, "size": [grid[1] * per, grid[0] * per]}

    def _checked(self, request: Request) -> tuple[ImageParams, list[int], tuple[Any, ...]]:
        opts = self.options
        params = image_params(
            request.params,
            steps=self.steps,
            max_steps=opts.max_steps,
            cfg_scale=self.cfg_scale,
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
        if not all(isinstance(ids, list) for ids in inputs[2:]):
            raise BadRequest("context_ids", "expected the cond and uncond contexts' token ids")
        if not opts.reuse_prefix:  # computed here: a lease sent anyway goes straight back
            self._give_back(request.data)
            return params, grid, (None, None, *inputs[2:], spans_of(request))
        if not all(isinstance(lease, dict) for lease in inputs[:2]):
            raise BadRequest(
                "kv_lease",
                "expected the cond and uncond KV leases (ar's lend_kv = false needs "
                "diffusion's reuse_prefix = false)",
            )
        return params, grid, (*inputs, [])

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

    def _prompt_rows(self) -> int:
        """On the engine thread: the prompt rows it has forwarded so far."""
        return self.engine.stats["prompt_tokens_computed"]

    async def _denoise(
        self,
        rid: str,
        inputs: tuple[Any, ...],
        grid: tuple[int, int],
        params: ImageParams,
        rows: list[int],
    ) -> AsyncGenerator[int | torch.Tensor, None]:
        """The loop over the borrowed context: yields 0 once it is kept, each step done, then
        the latent.

        The engine thread runs the block steps (those of concurrent requests batch in one
        forward); the model thread the image parts around them (patch_embed, final_layer,
        Euler), so the event loop computes nothing."""
        lease, uncond_lease, ids, uncond_ids, spans = inputs
        context = f"{rid}-ctx"
        # The engine reads the lent pages in place; release() hands the leases back. Not
        # lent: the first block step computes both contexts (a condition image's rows too).
        guidance = Guidance(
            uncond_ids, params.cfg_scale, spans or None, lease=uncond_lease, combine=False
        )
        try:
            # Cancelled while this waits, the keep still runs first, then the release.
            await self.engine.keep_context(
                context, ids, spans or None, guidance=guidance, lease=lease
            )
            yield 0
            loop = denoise_steps(
                self.backbone.parts,
                context,
                len(ids),
                grid,
                params.steps,
                params.cfg_scale,
                params.seed,
                self.shift,
            )
            run = await self._run(Denoising, loop, params.steps)
            while (step := run.request) is not None:
                delta = await self.engine.block_step(*step[:5])
                rows[0] += 2 * len(step.rows)  # both halves run the rows
                await self._run(run.feed, delta.hidden)
                yield step.step + 1
            assert run.latent is not None
            yield run.latent.float().contiguous()
        finally:
            self.engine.release(context)  # also when cancelled: the leases go back
