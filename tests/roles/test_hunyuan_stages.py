"""The HunyuanImage-3 pipeline deployed as separate stages: ar and diffusion each load their
own weights (share_weights = false), ar lends nothing (lend_kv = false) and diffusion
computes the prompt's KV itself (reuse_prefix = false), as it must when ar runs on another
host. Real processes, the shipped config with those options set."""

from __future__ import annotations

import asyncio
import io
import os
import tempfile
import tomllib
from pathlib import Path

import pytest
from PIL import Image

import omniflow
from omniflow.control.discovery import list_actors
from omniflow.runtime.config import parse
from tests.roles.media import image_bytes

ROOT = Path(__file__).resolve().parents[2]
SMALL = {"size": "64x64", "steps": 3, "seed": 1}
pytestmark = pytest.mark.slow


def stages_config(model: Path):
    raw = tomllib.loads((ROOT / "configs" / "hunyuan_image3.toml").read_text())
    raw.pop("gateway", None)
    raw["name"] = "hunyuan_stages_test"
    for role in raw["roles"].values():
        role["options"]["model_path"] = str(model)
    raw["roles"]["ar"]["options"] |= {"share_weights": False, "lend_kv": False}
    raw["roles"]["diffusion"]["options"] |= {"share_weights": False, "reuse_prefix": False}
    return parse(raw)


def png_of(outputs):
    [image] = [o for o in outputs if o.role == "vae_decoder"]
    return image.data["image"]


def test_separate_stages_compute_the_prompt_in_diffusion(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNIFLOW_RUN_ROOT", tempfile.mkdtemp(prefix="of-", dir="/tmp"))
    config = stages_config(tmp_path / "model")

    async def run():
        async with omniflow.Runtime(config) as rt:
            assert rt.client is not None
            records = {r.role: r for r in await list_actors(rt.client.registry, config.name)}
            ar, diffusion = records["ar"].meta["weights"], records["diffusion"].meta["weights"]
            assert ar["loaded"] and diffusion["loaded"]  # each loaded its own copy
            assert not ar["path"].startswith("/dev/shm/")
            assert not diffusion["path"].startswith("/dev/shm/")
            first = await rt.call({"text": "a red cube on a table"}, params=SMALL, timeout=120)
            again = await rt.call({"text": "a red cube on a table"}, params=SMALL, timeout=120)
            image = image_bytes(80, 48, seed=4)
            edited = await rt.call(
                {"text": "make it blue", "image": image}, params=SMALL, timeout=120
            )
            return first, again, edited

    (outputs, usage), (repeat, _), (edited, edited_usage) = asyncio.run(run())
    usage, edited_usage = usage.usage, edited_usage.usage
    # diffusion ran both contexts' rows itself (cond with the ratio token, and uncond).
    assert usage["diffusion_prompt_rows_forwarded"] == 2 * usage["prompt_tokens"]
    assert usage["ar_rows_forwarded"] == usage["prompt_tokens"] - 1  # the ratio pick alone
    assert usage["diffusion_rows_forwarded"] == SMALL["steps"] * 2 * (1 + 16)
    assert png_of(outputs) == png_of(repeat)  # same seed, same bytes
    assert Image.open(io.BytesIO(png_of(outputs))).size == (64, 64)
    # ti2i: the condition image's rows (ViT, clean latent) reached diffusion with the ids.
    assert edited_usage["prompt_tokens"] > usage["prompt_tokens"] + 16
    assert Image.open(io.BytesIO(png_of(edited))).size == (64, 64)
    assert os.path.isdir(tmp_path / "model")


def test_a_lease_left_unclaimed_is_revoked_while_diffusion_lives(tmp_path, monkeypatch):
    """The shared deployment, ar's claim bound short and diffusion one loop at a time: a
    second request's leases wait in diffusion's queue past the bound, as a lost message's
    would forever. ar takes them back, that request fails naming the revoked lease, and the
    pool returns to where it was, the same diffusion process serving on."""
    monkeypatch.setenv("OMNIFLOW_RUN_ROOT", tempfile.mkdtemp(prefix="of-", dir="/tmp"))
    raw = tomllib.loads((ROOT / "configs" / "hunyuan_image3.toml").read_text())
    raw.pop("gateway", None)
    raw["name"] = "hunyuan_revoke_test"
    for role in raw["roles"].values():
        role["options"]["model_path"] = str(tmp_path / "model")
    bound = 2.0  # long enough for a claim on a loaded machine
    raw["roles"]["ar"]["options"]["lease_claim_s"] = bound
    raw["roles"]["diffusion"]["max_concurrency"] = 1
    raw["roles"]["diffusion"]["options"]["max_steps"] = 1000
    config = parse(raw)

    async def run():
        async with omniflow.Runtime(config) as rt:
            assert rt.client is not None
            pool = rt.supervisor.pool
            assert pool is not None

            async def settled():
                last = None
                for _ in range(60):
                    stats = pool.stats()
                    now = (stats.used_pages, stats.live_leases)
                    if now == last:
                        return now
                    last = now
                    await asyncio.sleep(0.5)
                raise AssertionError(f"the pool never settled: {now}")

            await rt.call({"text": "warm"}, params=SMALL, timeout=120)
            before = await settled()
            first = {r.role: r for r in await list_actors(rt.client.registry, config.name)}
            # 1000 steps of 256 image tokens: diffusion's one loop is busy past the bound
            # on any CPU; left once the queued request's leases are revoked.
            long = {**SMALL, "steps": 1000, "size": "256x256"}
            stream = rt.stream({"text": "a long one"}, params=long, timeout=300)
            await anext(stream)  # its first step: diffusion runs it now
            queued = asyncio.create_task(rt.call({"text": "queued"}, params=SMALL, timeout=120))
            await asyncio.sleep(bound + 1.0)
            await stream.aclose()  # cancels it: diffusion takes the queued one
            with pytest.raises(omniflow.RequestFailed) as failed:
                await queued
            after = await settled()
            again = {r.role: r for r in await list_actors(rt.client.registry, config.name)}
            outputs, _ = await rt.call({"text": "a red cube"}, params=SMALL, timeout=120)
            return failed.value, before, after, first, again, outputs

    failure, before, after, first, again, outputs = asyncio.run(run())
    assert "revoked by its lender" in failure.detail, failure.detail
    assert after == before  # no page of the revoked leases left behind
    assert first["diffusion"].pid == again["diffusion"].pid  # the borrower lived throughout
    assert png_of(outputs).startswith(b"\x89PNG")
