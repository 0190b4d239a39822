"""``ar`` role of the HunyuanImage-3 pipeline: prompt → context KV, lent to ``diffusion``.

Input (from the client):
    data["text"]: str                       the prompt
    data["image"]: bytes (optional)         a condition image (ti2i): PNG, JPEG, ...
    params: seed, steps, cfg_scale, size ("WxH" in pixels or "auto")  checked here first
Output (to diffusion):
    kv_lease, kv_lease_uncond: dict         read-only leases on the cond and uncond context KV
    context_ids, uncond_ids: list[int]      the tokens each lease holds
    grid: [h, w]                            image tokens to make
    size: [width, height]                   pixels

Everything runs in the engine over the backbone weights this role maps from the host pool
(the diffusion role maps the same pages). The context is the release's sequence template
(models/hunyuan_image3/template.py; ``sequence_template`` 'pretrain' or 'instruct', an
optional system prompt) up to the ratio token:

    <bos> [system] [condition image: <timestep> + clean latent rows, ViT rows] prompt
    [<recaption> text </recaption>] <boi> <img_size> <img_ratio>

With size "auto" the ratio token is the one AR step's pick among the 33 ratio tokens
(sampling restricted to them); a given size fixes it. The unconditional context replaces
the text by as many ``<cfg>`` tokens. Both are computed once and lent (``lend_kv_to``) to
the diffusion replica this request goes to: diffusion never recomputes them.

Options: ``HunyuanAROptions`` in roles/options.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import io
import itertools
from typing import Any

import msgspec
import torch
from PIL import Image

from omniflow.engine import AsyncEngine, EmbeddingSpan, EngineConfig, LLMEngine, SamplingParams
from omniflow.kv.share import revoke
from omniflow.models.hunyuan_image3.config import generation_template
from omniflow.models.hunyuan_image3.template import SequenceTemplate
from omniflow.models.hunyuan_image3.tokens import ImageTokens, grid_of_ratio, ratio_of_size
from omniflow.roles.base import ModelActor
from omniflow.roles.hunyuan_backbone import Backbone, span_fields
from omniflow.roles.hunyuan_prompt import Condition, condition_spans, encode_condition
from omniflow.roles.image_params import image_params
from omniflow.roles.options import HunyuanAROptions, TextToImageParams
from omniflow.runtime.actor import BadRequest, Context, MemoryBudget, Request
from omniflow.runtime.priority import lower_thread_priority


class ARRole(ModelActor):
    Options = HunyuanAROptions
    Params = TextToImageParams
    options: HunyuanAROptions

    async def setup(self) -> None:
        opts = self.options
        self.start_model_thread()
        self.backbone = await self._run(Backbone.load, opts, self.pool, self.role)
        self.config = self.backbone.config
        self.tokens = ImageTokens.from_tokenizer(self.backbone.tokenizer)
        name, system = generation_template(
            opts.model_path, opts.sequence_template, opts.system_prompt
        )
        tokenizer = self.backbone.tokenizer
        self.template = SequenceTemplate(
            self.tokens, lambda text: tokenizer.encode(text, add_special_tokens=False), name, system
        )
        if opts.recaption_tokens:
            self.template.recaption_stops()  # the tokenizer has them
        self._ids = itertools.count()
        self.engine = self._engine(opts.kv_cache_mb << 20)
        self.weights = self.backbone.where()  # as the engine runs them
        # A lease ends when diffusion lets go; the engine unlocks its pages at its next
        # step, so an idle engine is nudged while leases are open.
        self._reaper = asyncio.create_task(self._reap_leases())

    def _engine(self, kv_bytes: int) -> AsyncEngine:
        config = EngineConfig(
            device=self.options.device,
            kv_cache_bytes=kv_bytes,
            share_kv=self.pool is not None,
            lease_claim_s=self.options.lease_claim_s,
            # Shared weights stay in the pages diffusion maps too (no private re-layout).
            relayout_weights=self.backbone.weights is None,
        )
        engine = LLMEngine(self.backbone.model, config, self.backbone.tokenizer, self.pool)
        return AsyncEngine(
            engine,
            thread_setup=functools.partial(lower_thread_priority, self.model_nice),
            on_death=self.engine_died,
        )

    async def reserve(self, budget: MemoryBudget) -> None:
        """Co-located with diffusion: the KV takes at most this role's share of memory."""
        wanted = self.options.kv_cache_mb << 20
        if budget.bytes < wanted:
            await self.engine.close()
            self.engine = self._engine(max(budget.bytes, 1 << 20))

    async def _reap_leases(self) -> None:
        while True:
            await asyncio.sleep(0.2)
            if self.engine.lends_kv():
                await self.engine.call(lambda: None)  # a step follows, which reaps

    async def close(self) -> None:
        self._reaper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reaper
        await self.engine.close()
        await super().close()
        self.backbone.close()  # after the engine: nothing reads the weights any more

    def meta(self) -> dict[str, Any]:
        weights = getattr(self, "weights", None)
        return {} if weights is None else {"weights": weights}

    async def handle(self, request: Request, ctx: Context):
        opts = self.options
        text = request.data.get("text", "")
        if not isinstance(text, str) or not text:
            raise BadRequest("text", f"expected a non-empty string, got {text!r}")
        want = request.params.get("want", "image")
        if want not in ("image", ["image"]):
            raise BadRequest("want", f"this pipeline makes images only, got {want!r}")
        per = self.config.pixels_per_token
        params = image_params(
            request.params,
            steps=1,
            max_steps=None,  # diffusion owns the steps' range; the type is checked here
            cfg_scale=0.0,
            pixels_per_token=per,
            max_tokens=opts.max_image_tokens,
        )
        prompt = self.backbone.tokenizer.encode(text, add_special_tokens=False)
        if len(prompt) > opts.max_prompt_tokens:
            raise BadRequest(
                "text", f"{len(prompt)} tokens exceeds the limit of {opts.max_prompt_tokens}"
            )
        image = request.data.get("image")
        conditions: list[Condition] = []
        if image is not None:
            pixels = await self._run(self._image, image)  # decoding is compute
            conditions = [await self._run(self._condition, pixels)]
        ratios = list(self.tokens.ratios)
        if params.size is not None:  # the ratio token is the size's, not the model's pick
            width, height = params.size
            ratios = [ratios[ratio_of_size(self.config, height, width)]]
        rid = f"{request.request_id}-{next(self._ids)}"
        borrower = ctx.peer_pid(opts.lend_to) if opts.lend_kv else 0  # where it goes next
        lease = uncond_lease = None
        try:
            infos = [c.info for c in conditions]
            cot = await self._recaption(rid, list(prompt), conditions)
            base = self.config.image_base_size
            layout = self.template.context(prompt, base, 0, (1, 1), infos, cot)
            spans = condition_spans(conditions, layout)
            cond = layout.ids[:-1]  # the ratio step's prompt: up to <img_size>
            ratio_id = await self._pick_ratio(rid, cond, spans, ratios, keep=opts.lend_kv)
            ratio = self.tokens.ratios.index(ratio_id)
            uncond = self.template.context(prompt, base, ratio, (1, 1), infos, cot, True).ids
            if opts.lend_kv:
                lease, uncond_lease = await self._lend_both(rid, uncond, spans, borrower)
        except ValueError as e:  # the engine refused the request (length, ...)
            raise BadRequest("text", str(e)) from None
        finally:
            self.engine.release(f"{rid}-c")  # a no-op once the continuation took it
        if params.size is None:
            grid = grid_of_ratio(self.config, ratio)
        else:
            grid = (params.size[1] // per, params.size[0] // per)
        out: dict[str, Any] = {
            "grid": list(grid),
            "context_ids": [*cond, self.tokens.ratios[ratio]],
            "uncond_ids": uncond,
            "size": [grid[1] * per, grid[0] * per],
            "ratio": ratio,
        }
        if lease is None:  # diffusion computes the context: it needs the image's rows too
            out |= span_fields(spans)
            ctx.add_usage(prompt_tokens=len(cond) + 1, ar_rows_forwarded=len(cond))
            yield out
            return
        out["kv_lease"] = msgspec.to_builtins(lease)
        out["kv_lease_uncond"] = msgspec.to_builtins(uncond_lease)
        ctx.add_usage(prompt_tokens=len(cond) + 1, ar_rows_forwarded=len(cond) + 1 + len(uncond))
        try:
            yield out
        except BaseException:  # not delivered (the send failed, the request ended here)
            self._revoke(lease, borrower)
            self._revoke(uncond_lease, borrower)
            raise

    async def _pick_ratio(
        self,
        rid: str,
        prompt: list[int],
        spans: list[EmbeddingSpan],
        ratios: list[int],
        keep: bool,
    ) -> int:
        """One AR step over the prompt up to <img_size> that picks the ratio token among
        ``ratios`` (kept as ``{rid}-c`` with ``keep``, for a continuation)."""
        pick = SamplingParams(max_tokens=1, temperature=0.0, allowed_token_ids=ratios)
        ratio = None
        async for delta in self.engine.generate(f"{rid}-c", prompt, pick, spans or None, keep=keep):
            ratio = delta.token_ids[-1] if delta.token_ids else ratio
        if ratio is None:
            raise RuntimeError(f"request {rid}: the ratio step made no token")
        return ratio

    async def _lend_both(
        self, rid: str, uncond: list[int], spans: list[EmbeddingSpan], borrower: int
    ) -> tuple[Any, Any]:
        """Lease the cond context (the kept ratio step's: its sampled ratio token runs now)
        and the uncond one to ``borrower``, both in the same engine steps. A failure of
        either revokes the other's lease: none is left lent that will not be delivered."""
        done = await asyncio.gather(
            self._lend(f"{rid}-l", [], [], borrower, continue_from=f"{rid}-c"),
            self._lend(f"{rid}-u", uncond, spans, borrower),
            return_exceptions=True,
        )
        failed = [r for r in done if isinstance(r, BaseException)]
        if failed:
            for lease in done:
                if not isinstance(lease, BaseException):
                    self._revoke(lease, borrower)
            raise failed[0]
        return done[0], done[1]

    def _revoke(self, lease: Any, borrower: int) -> None:
        """A lease that will never reach ``borrower``: taken back unless already claimed."""
        assert self.pool is not None
        revoke(self.pool, lease, borrower)

    async def _lend(
        self,
        rid: str,
        prompt: list[int],
        spans: list[EmbeddingSpan],
        borrower: int,
        continue_from: str | None = None,
    ) -> Any:
        """Compute a context (or the rest of a kept one) and lease its KV to ``borrower``."""
        params = SamplingParams(max_tokens=1, temperature=0.0)
        lease = None
        async for delta in self.engine.generate(
            rid, prompt, params, spans or None, lend_kv_to=borrower, continue_from=continue_from
        ):
            if delta.kv_lease is not None:
                lease = delta.kv_lease
        if lease is None:
            raise RuntimeError(f"request {rid}: the engine finished without a KV lease")
        return lease

    async def _recaption(
        self, rid: str, prompt: list[int], conditions: list[Condition]
    ) -> list[int] | None:
        """The optional AR stage before the image (the release's bot_task 'recaption'):
        greedy text after <recaption>, up to </recaption> (or </answer>, <eos>, the token
        budget); None with recaption_tokens 0."""
        if not self.options.recaption_tokens:
            return None
        layout = self.template.recaption_prompt(prompt, [c.info for c in conditions])
        spans = condition_spans(conditions, layout)
        stops = self.template.recaption_stops()
        params = SamplingParams(
            max_tokens=self.options.recaption_tokens, temperature=0.0, stop_token_ids=stops
        )
        ids: list[int] = []
        async for delta in self.engine.generate(f"{rid}-r", layout.ids, params, spans or None):
            ids += delta.token_ids
        return [t for t in ids if t not in stops]

    def _image(self, data: Any) -> torch.Tensor:
        """The condition image, decoded, resized and centre-cropped to the ratio bucket
        nearest its shape (the release's image_processor): RGB uint8 [H, W, 3]."""
        if not isinstance(data, bytes) or not data:
            raise BadRequest("image", "expected the bytes of an image file")
        if len(data) > self.options.max_image_bytes:
            raise BadRequest("image", f"{len(data)} bytes exceeds the limit (max_image_bytes)")
        try:
            with Image.open(io.BytesIO(data)) as img:
                if img.width * img.height > self.options.max_image_pixels:
                    raise BadRequest(
                        "image", f"{img.width}x{img.height} exceeds the limit (max_image_pixels)"
                    )
                per = self.config.pixels_per_token
                ratio = ratio_of_size(self.config, img.height, img.width)
                h, w = grid_of_ratio(self.config, ratio)
                rgb = resize_and_crop(img.convert("RGB"), w * per, h * per)
        except BadRequest:
            raise
        except Exception as e:  # noqa: BLE001 - Pillow raises many kinds for a bad file
            raise BadRequest("image", f"cannot decode the image: {type(e).__name__}: {e}") from None
        return torch.frombuffer(bytearray(rgb.tobytes()), dtype=torch.uint8).view(
            rgb.height, rgb.width, 3
        )

    def _condition(self, pixels: torch.Tensor) -> Condition:
        """A condition image's token counts and rows: its clean latent (time 0) and its ViT
        rows, keyed by content in the prefix cache."""
        with torch.inference_mode():
            return encode_condition(self.backbone.parts, pixels)


def resize_and_crop(image: Image.Image, width: int, height: int) -> Image.Image:
    """Scale (LANCZOS) until the image covers width x height, then crop the centre: the
    release's resize_and_crop, its rounding included."""
    if image.height / image.width < height / width:
        size = (int(round(height / image.height * image.width)), height)
    else:
        size = (width, int(round(width / image.width * image.height)))
    image = image.resize(size, resample=Image.Resampling.LANCZOS)
    top, left = int(round((size[1] - height) / 2.0)), int(round((size[0] - width) / 2.0))
    return image.crop((left, top, left + width, top + height))
